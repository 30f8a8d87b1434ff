"""Build hook: compiles the C core through cffi (see aiote/_native/_build.py)."""

from setuptools import setup

setup(cffi_modules=["aiote/_native/_build.py:ffibuilder"])
