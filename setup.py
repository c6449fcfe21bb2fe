"""The one compiled part: :mod:`snapstore._stream`, a copy with streaming
stores (see its source). Optional: without a C compiler the build skips it and
snapstore copies with numpy (slower saves and restores, the same bytes)."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("snapstore._stream", ["snapstore/_stream.c"], optional=True,
                             extra_compile_args=["-O2"])])
