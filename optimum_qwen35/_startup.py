"""The registration hook, installed by `import optimum_qwen35` and by the `optimum_qwen35.pth` start-up file.

Standard library only. Once the program imports `transformers` or `optimum.neuron` (or right away, for
those already imported), Qwen3.5 is registered there (see `optimum_neuron/registration.py`). A program that imports
neither pays nothing; one that imports transformers >= 5 (which has Qwen3.5) pays a version check, and, once its Auto
model classes import, the wrapper that sends exports (not checkpoints) to this package's class (`neuron_model/auto.py`).
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import warnings

REGISTRATION = "optimum_qwen35.optimum_neuron.registration"
MODEL_MODULE = "optimum_qwen35.optimum_neuron.modeling"  # registers its class in optimum-neuron's registry
AUTO_EXPORTS = "optimum_qwen35.neuron_model.auto"
# watched module -> (module to import, function of it to call or None, the transformers major version it is for or None)
_HOOKS = {
    "transformers": (REGISTRATION, "register_transformers", "4"),
    "transformers.pipelines": (REGISTRATION, "register_pipeline_loader", "4"),
    # transformers >= 5 has Qwen3.5 itself: only exports need this package's class (neuron_model/auto.py).
    "transformers.models.auto.modeling_auto": (AUTO_EXPORTS, "register_auto_model", "5+"),
    "optimum.neuron": (MODEL_MODULE, None, None),
}


def _run(watched: str, module) -> None:
    target, function, major = _HOOKS[watched]
    transformers = sys.modules.get("transformers", module)
    if major is not None and getattr(transformers, "__version__", "5").startswith("4.") != (major == "4"):
        return
    try:
        # A module already importing (the model module importing optimum.neuron) is returned as it is: it registers
        # its class when it is done.
        registered = importlib.import_module(target)
        if function is not None:
            getattr(registered, function)()
    except Exception as error:  # noqa: BLE001 (an import hook must never break the program's import)
        warnings.warn(f"optimum-qwen35 could not register Qwen3.5 ({watched}): {error}", stacklevel=2)


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of the watched modules so that the hook runs after them."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _HOOKS:
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
                if fullname == "optimum.neuron":  # its device probe and trn1-override warning: noise here
                    from optimum_qwen35.patches import optimum_neuron_import  # start-up time: stdlib only until here

                    with optimum_neuron_import():
                        loader.exec_module(module)
                else:
                    loader.exec_module(module)
                _run(fullname, module)

            def __getattr__(self, name):  # get_resource_reader, is_package, ...: the real loader's
                return getattr(loader, name)

        spec.loader = _Loader()
        return spec


def install() -> None:
    """Watch for the modules of `_HOOKS`; run the hooks of those already imported now."""
    if any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _RegisterAfterImport())
    for name in _HOOKS:
        if name in sys.modules:
            _run(name, sys.modules[name])
