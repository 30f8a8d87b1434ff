"""Build hooks: compiles the C core through cffi (see aiote/_native/_build.py), and ships the
C core's and the C bench's sources in the package (aiote/_native/csrc), so that an installed
`aiote bench` can build its C baseline from the very code the extension was built from."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

_HERE = Path(__file__).resolve().parent
_CSRC = {  # source in the checkout -> place in the package
    "cdeps/aiote_core.h": "aiote/_native/csrc/aiote_core.h",
    # the core, one file per concern, with its internal headers
    **{
        f"cdeps/core/{p.name}": f"aiote/_native/csrc/core/{p.name}"
        for p in sorted((_HERE / "cdeps" / "core").glob("*.[ch]"))
    },
    # the C bench: aiote_cbench.c (main) and its parts, with their header
    **{
        f"cdeps/bench/{p.name}": f"aiote/_native/csrc/bench/{p.name}"
        for p in sorted((_HERE / "cdeps" / "bench").glob("*.[ch]"))
    },
}


class _BuildPyWithCSources(build_py):
    def run(self) -> None:
        super().run()
        for src, dst in _CSRC.items():
            out = Path(self.build_lib) / dst
            out.parent.mkdir(parents=True, exist_ok=True)
            self.copy_file(str(_HERE / src), str(out))


setup(cffi_modules=["aiote/_native/_build.py:ffibuilder"], cmdclass={"build_py": _BuildPyWithCSources})
