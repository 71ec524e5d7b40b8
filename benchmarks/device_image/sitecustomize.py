"""The lent GPU image's packages, enforced: with this folder on PYTHONPATH and DEBERTA_IMAGE_GUARD=1, a Python
process can import only the standard library, local code (the repository) and the distributions listed in
packages.txt (the image's) and carried.txt (the wheels the device check brings), so that the CPU rehearsal of the
device check (`bash benchmarks/gpu_check.sh --rehearse`) fails here on an import the image could not serve, not on
the device. A blocked import raises ModuleNotFoundError, as on the image: code that treats a package as optional
behaves as it would there.

Python imports `sitecustomize` at start-up from the path; a project's own on PYTHONPATH is found before a
virtual environment's (which has none).
"""

import os

if os.environ.get("DEBERTA_IMAGE_GUARD") == "1":
    import importlib.abc
    import importlib.metadata
    import re
    import sys
    from pathlib import Path

    def _names(file):
        lines = (Path(__file__).with_name(file)).read_text().splitlines()
        return {re.sub(r"[-_.]+", "-", line.strip()).lower() for line in lines if line.strip()[:1].isalnum()}

    _ALLOWED = _names("packages.txt") | _names("carried.txt")
    _BY_MODULE = importlib.metadata.packages_distributions()

    class _ImageGuard(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if "." in name or name in sys.stdlib_module_names or name not in _BY_MODULE:
                return None  # submodules follow their package; stdlib and local code pass
            distributions = _BY_MODULE[name]
            if any(re.sub(r"[-_.]+", "-", d).lower() in _ALLOWED for d in distributions):
                return None
            raise ModuleNotFoundError(
                f"{name} (from {', '.join(distributions)}) is not on the lent GPU image "
                "(benchmarks/device_image/packages.txt): carry its wheel (benchmarks/device_image/carried.txt, "
                "benchmarks/gpu_wheels.sh) or do without it", name=name)

    sys.meta_path.insert(0, _ImageGuard())
