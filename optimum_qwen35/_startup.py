"""The registration hook, installed by `import optimum_qwen35` and by the `optimum_qwen35.pth` start-up file.

Standard library only. Once the program imports `transformers` or `optimum.neuron` (or right away, for
those already imported), Qwen3.5 is registered there (see `optimum.registration`). A program that imports
neither pays nothing; one that imports transformers >= 5 (which has Qwen3.5) pays a version check.
"""

from __future__ import annotations

import importlib.abc
import sys
import warnings

_HOOKS = {
    "transformers": "register_transformers",
    "transformers.pipelines": "register_pipeline_loader",
    "optimum.neuron": "register_optimum_neuron",
}


def _run(hook: str, module) -> None:
    transformers = sys.modules.get("transformers", module)
    if hook != "register_optimum_neuron" and not getattr(transformers, "__version__", "5").startswith("4."):
        return  # transformers >= 5 has Qwen3.5 itself
    try:
        from optimum_qwen35.optimum import registration

        getattr(registration, hook)()
    except Exception as error:  # noqa: BLE001 (an import hook must never break the program's import)
        warnings.warn(f"optimum-qwen35 could not register Qwen3.5 ({hook}): {error}", stacklevel=2)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of the watched modules so that the hook runs after them."""

    def find_spec(self, fullname, path, target=None):
        hook = _HOOKS.get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                if hook == "register_optimum_neuron":  # its device probe and trn1-override warning: noise here
                    from optimum_qwen35.quiet import optimum_neuron_import

                    with optimum_neuron_import():
                        loader.exec_module(module)
                else:
                    loader.exec_module(module)
                _run(hook, module)

            def __getattr__(self, name):  # get_resource_reader, is_package, ...: the real loader's
                return getattr(loader, name)

        spec.loader = _Loader()
        return spec


def install() -> None:
    """Watch for the modules of `_HOOKS`; run the hooks of those already imported now."""
    if any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _RegisterAfterImport())
    for name, hook in _HOOKS.items():
        if name in sys.modules:
            _run(hook, sys.modules[name])
