"""snapstore benchmarks: each module has ``main(argv)`` and prints JSON."""
