"""The TorchRec this process imports, for tests that need a newer one than a machine carries
(the project pins 1.8; a GPU machine may carry an older one, docs/gpu.md). No side effects:
imported by test modules that run parts of themselves in fresh interpreters."""
import importlib.metadata


def _major_minor(version: str) -> tuple:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


#: (major, minor) of the installed TorchRec
TORCHREC_VERSION = _major_minor(importlib.metadata.version("torchrec"))


def needs_torchrec_18(what: str) -> str:
    """The reason a test that needs TorchRec 1.8 skips with on an older TorchRec; ``what``:
    the 1.8 feature it needs."""
    return (f"needs TorchRec 1.8 ({what}); this is TorchRec "
            f"{'.'.join(map(str, TORCHREC_VERSION))}")
