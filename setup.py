"""The one compiled part: :mod:`snapstore._stream`, a copy fused with its
crc32c in one pass, streaming stores (see its source). Optional: without a C
compiler the build skips it and snapstore copies with numpy and checksums with
the crc32c package (the same bytes and checksums, slower saves and restores)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("snapstore._stream", ["snapstore/_stream.c"], optional=True,
                             extra_compile_args=["-O2"])])
