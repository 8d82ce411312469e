"""Import stand-ins for the closed modules of the Neuron SDK 2.26, for the nox `neuron` session only.

What it stands in for, exactly:
- `torch_neuronx` (torch-neuronx 2.8.0.2.10.16998): the PyTorch/XLA plugin that lowers traced graphs to HLO
  (`xla_impl.trace.generate_hlo`), calls the compiler and loads NEFFs into the Neuron runtime;
- `neuronxcc` (neuronx-cc 2.21.33363.0): the compiler and its NKI package (`neuronxcc.nki`);
- `libneuronxla` (2.2.12677.0): the compiler driver and its compile cache (`neuron_xla_compile`);
- `torch.classes.neuron` (`SPMDModel`, `LayoutTransformation`, ...): the runtime's TorchScript classes, which the
  real `torch_neuronx` registers when it is imported.

Why: neuronx-distributed 0.15 and optimum-neuron 0.4.5 import these at import time, and PyPI has only placeholders of
them. With these stand-ins the open source (neuronx-distributed's layers, mappings, parallel state and ModelBuilder,
optimum-neuron's model classes, builders and wrappers, torch-xla) imports and runs as it is, on the XLA CPU device.

Nothing here compiles, lowers or runs Neuron code. Every function, class or constant of the closed SDK is a
`ClosedName`: calling a function raises `NeuronSDKUnavailable` naming it, so a run stops at the first closed call
and says where (the tests assert that boundary). A class (a CamelCase name) is a `ClosedClass`: the open source
subclasses some at import time (optimum-neuron's Hub compile cache extends `libneuronxla`'s `CompileCache`) and builds
configuration records of others (`SkipMode(False, False)`), so it can be subclassed and instantiated, and any
method or attribute it does not define itself is a closed name (calling it raises). The only things given are the ones read at import
time:
- `__version__` strings (labelled `+standin`, so an export written here never passes for the real SDK's);
- the decorators the open source applies to its NKI kernels at import time (`neuronxcc.nki.jit`, `torch_neuronx`'s
  `nki_jit`, `xla_hlo_call`), which return a `ClosedName` for the decorated function instead of compiling it;
- `torch_neuronx.utils.get_platform_target()`, which neuronx-distributed calls at import time: it answers with
  `NEURON_PLATFORM_TARGET_OVERRIDE` (which optimum-neuron sets, and which is how the real function is told the
  target on a machine without a device) and raises without it (the real one would probe the instance).
"""

from __future__ import annotations

import importlib.abc
import os
import importlib.machinery
import sys
import types

CLOSED_PACKAGES = ("torch_neuronx", "neuronxcc", "libneuronxla")
VERSIONS = {
    "torch_neuronx": "2.8.0.2.10.16998+standin",
    "neuronxcc": "2.21.33363.0+standin",
    "libneuronxla": "2.2.12677.0+standin",
}
# Decorators (or decorator factories) applied to kernels at import time by the open source.
DECORATORS = {
    "neuronxcc.nki.jit",
    "neuronxcc.nki.compiler.skip_middle_end_transformations",
    "neuronxcc.nki.compiler.enable_stack_allocator",
    "torch_neuronx.xla_impl.ops.nki_jit",
    "torch_neuronx.xla_impl.ops.xla_hlo_call",
    "torch_neuronx.xla_impl.base.xla_hlo_call",
    "torch_neuronx.xla_impl.base.xla_call",
}
# Closed modules that are absent rather than stood in for: importing them raises ImportError, as on a machine
# without the SDK. torch-xla probes for the Neuron PJRT plugin at import time and, without it, runs on its CPU device.
ABSENT = {"libneuronxla.libneuronpjrt_path": "the Neuron PJRT device plugin"}
# Every closed name touched in this process, in order (the tests read it to say what was stood in for).
TOUCHED: list[str] = []


class NeuronSDKUnavailable(RuntimeError):
    """A closed Neuron SDK name was called: this process has only the import stand-ins."""


class ClosedName:
    """A name of the closed SDK: attributes and subscripts give further closed names; a call raises."""

    def __init__(self, qualname: str, decorator: bool = False):
        self._qualname, self._decorator = qualname, decorator
        TOUCHED.append(qualname)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return ClosedName(f"{self._qualname}.{name}")

    def __getitem__(self, key):
        return ClosedName(f"{self._qualname}[...]")

    def __call__(self, *args, **kwargs):
        if self._decorator:
            if len(args) == 1 and not kwargs and callable(args[0]):
                return ClosedName(f"{self._qualname}({getattr(args[0], '__name__', '?')})")
            return ClosedName(f"{self._qualname}(...)", decorator=True)  # a decorator factory's result
        raise NeuronSDKUnavailable(
            f"{self._qualname} is part of the closed Neuron SDK, which is not installed here (only import "
            "stand-ins, tests/neuron_sdk_standin): nothing of it runs without an AWS Neuron machine"
        )

    def __repr__(self):
        return f"<closed Neuron SDK name {self._qualname}>"


class _ClosedClassMeta(type):
    def __getattr__(cls, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return ClosedName(f"{cls._qualname}.{name}")


class ClosedClass(metaclass=_ClosedClassMeta):
    """Base of every closed class: instances hold nothing; what a subclass does not define is a closed name."""

    _qualname = "?"

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return ClosedName(f"{type(self)._qualname}().{name}")


def closed_class(qualname: str) -> type:
    TOUCHED.append(qualname)
    return _ClosedClassMeta(qualname.rsplit(".", 1)[-1], (ClosedClass,), {"_qualname": qualname, "__module__": qualname.rsplit(".", 1)[0]})


class StandInModule(types.ModuleType):
    """A closed module: any public attribute is a `ClosedName` (a package: its submodules import too)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        qualname = f"{self.__name__}.{name}"
        if qualname in GIVEN:
            value = GIVEN[qualname]
        elif name[:1].isupper() and not name.isupper():
            value = closed_class(qualname)
        else:
            value = ClosedName(qualname, decorator=qualname in DECORATORS)
        setattr(self, name, value)
        return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves every submodule of the closed packages (they have no files) as a `StandInModule`."""

    def find_spec(self, fullname, path=None, target=None):
        for absent, what in ABSENT.items():
            if fullname == absent or fullname.startswith(absent + "."):
                raise ImportError(f"{fullname} ({what}) is not stood in for: it is absent, as without the SDK")
        if fullname.split(".")[0] in CLOSED_PACKAGES and "." in fullname:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = StandInModule(spec.name, f"stand-in for the closed Neuron SDK module {spec.name}")
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def get_platform_target() -> str:
    """torch_neuronx.utils.get_platform_target, as far as it goes without a device: the override, else an error."""
    target = os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE")
    if not target:
        raise NeuronSDKUnavailable(
            "torch_neuronx.utils.get_platform_target: no NEURON_PLATFORM_TARGET_OVERRIDE, and no instance to probe"
        )
    return target


# Closed functions read at import time, with what they answer here.
GIVEN = {"torch_neuronx.utils.get_platform_target": get_platform_target, "torch_neuronx.utils.utils.get_platform_target": get_platform_target}


def stand_in(package: types.ModuleType) -> None:
    """Make the top-level closed `package` a stand-in: its version, its submodules, closed names for the rest."""
    package.__class__ = StandInModule
    package.__version__ = VERSIONS[package.__name__]
    if not any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        sys.meta_path.append(_StandInFinder())
    if package.__name__ == "torch_neuronx":
        import torch  # noqa: PLC0415

        # The real torch_neuronx registers the runtime's TorchScript classes on import; annotations read them.
        torch.classes.neuron = StandInModule("torch.classes.neuron")
