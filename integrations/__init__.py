"""Edges of snapstore: Orbax, Pathways, MaxText. Import as ``snapstore.integrations``."""
