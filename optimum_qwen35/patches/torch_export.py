"""torch 2.8, 2.13 and 2.14: `torch.export.save` and `torch.export.load` (the cpu target's program files) faster, the
files' bytes and the loaded programs unchanged (`torch_export_files_faster`; tests/test_torch_export_files.py).

- `torch.export.load` builds the program's schema dataclasses from JSON (`serialize._dict_to_dataclass`), working out
  again for every object what its class's fields are and what they hold (`typing.get_type_hints`, `get_origin`,
  `dataclasses.fields`): most of a load's time. On every version here the deserializer's `typing` answers
  `get_type_hints` from a cache per class (a tiny export's 12 programs, 21.4 s of CPU -> 10.6 s); on 2.13 and 2.14
  `_dict_to_dataclass` itself is replaced by `_SchemaFromJson`, which works out each class's conversion once and then
  applies it (the same function: 2.13's and 2.14's are the same code; 2.8's differs and keeps its own).
- `torch.export.save` canonicalizes the serialized program it has just built after `copy.deepcopy` of it (a third of
  the save). The serializer's `copy.deepcopy` is a pickle round trip there: the same deep copy, in C (14.0 s -> 11.4 s).
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import types
import typing

from optimum_qwen35.patches.versions import _supported


class _TypingWithCachedHints(types.ModuleType):
    """`typing` as torch's export deserializer sees it: `get_type_hints` of a class computed once."""

    def __init__(self):
        super().__init__("typing")
        self._hints = {}

    def __getattr__(self, name):
        return getattr(typing, name)

    def get_type_hints(self, obj, globalns=None, localns=None, include_extras=False):
        if not isinstance(obj, type) or localns is not None:
            return typing.get_type_hints(obj, globalns, localns, include_extras)
        key = (obj, id(globalns), include_extras)  # the deserializer passes one namespace (its schema module) or none
        if key not in self._hints:
            self._hints[key] = typing.get_type_hints(obj, globalns, localns, include_extras)
        return dict(self._hints[key])  # callers may change theirs


class _CopyByPickle(types.ModuleType):
    """`copy` as torch's export serializer sees it: `deepcopy` of its own schema dataclasses as a pickle round trip
    (what it copies is built of dataclasses, enums, lists, dicts and strings; anything that does not pickle is copied
    by `copy.deepcopy`)."""

    def __init__(self):
        super().__init__("copy")

    def __getattr__(self, name):
        return getattr(copy, name)

    def deepcopy(self, obj, memo=None):
        if memo is None:
            try:
                return pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
            except (pickle.PicklingError, TypeError, AttributeError):
                pass
        return copy.deepcopy(obj, memo)


class _SchemaFromJson:
    """torch 2.13 / 2.14's `serialize._dict_to_dataclass(cls, data)`, with each class's conversion worked out once.

    The same rules in the same order: a schema class named by a string or forward reference is resolved; `Annotated`
    converts as its type; `Optional` passes None; a schema union (`_Union`) is a one-key dict, built with `create`; a
    dataclass takes the keys it declares (others are ignored, for forward compatibility) in field order; then by the
    data: a list converts its items (an empty one is returned as it is), a dict its values, a float type makes a float,
    anything else is returned as it is."""

    def __init__(self, serialize):
        self.serialize = serialize
        self.original = serialize._dict_to_dataclass  # torch's own (what it replaces)
        self.converters = {}

    def __call__(self, cls, data):
        return self.converter(cls)(data)

    def converter(self, cls):
        try:
            return self.converters[cls]
        except KeyError:
            converter = self.converters[cls] = self._build(cls)
            return converter
        except TypeError:  # an unhashable type argument: not cached
            return self._build(cls)

    def _build(self, cls):
        serialize = self.serialize
        cls = serialize._resolve_schema_cls(cls)
        if isinstance(cls, str):
            raise AssertionError(f"Unresolved class type: '{cls}'.")
        origin = typing.get_origin(cls)
        if origin is typing.Annotated:
            inner = cls.__origin__
            return lambda data: self.converter(inner)(data)
        args = typing.get_args(cls)
        if origin in (typing.Union, types.UnionType) and type(None) in args:
            def optional(data):
                if data is None:
                    return None
                if len(args) != 2:
                    raise AssertionError(f"expected 2 type args, got {len(args)}")
                return self.converter(args[0])(data)

            return optional
        if isinstance(cls, type) and issubclass(cls, serialize._Union):
            hints = typing.get_type_hints(cls, globalns=vars(serialize.schema))

            def union(data):
                if not isinstance(data, dict):
                    raise AssertionError(f"expected dict, got {type(data).__name__}")
                if len(data) != 1:
                    raise AssertionError(f"expected dict with 1 key, got {len(data)}")
                ((key, value),) = data.items()
                if not isinstance(key, str):
                    raise AssertionError(f"expected str key, got {type(key).__name__}")
                return cls.create(**{key: self.converter(hints[key])(value)})

            return union
        if dataclasses.is_dataclass(cls):
            hints = typing.get_type_hints(cls, globalns=vars(serialize.schema))
            fields = [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]
            return lambda data: cls(**{name: self.converter(t)(data[name]) for name, t in fields if name in data})

        def by_data(data):
            if isinstance(data, list):
                if len(data) == 0:
                    return data
                item = self.converter(args[0])
                return [item(d) for d in data]
            if isinstance(data, dict):
                if not data:
                    return {}
                value = self.converter(args[1])
                return {k: value(v) for k, v in data.items()}
            if cls is float:
                return float(data)
            return data

        return by_data


def torch_export_files_faster() -> None:
    """Make `torch.export.save` and `torch.export.load` of this process faster, their results unchanged (module
    docstring). Idempotent; on another torch version it changes nothing."""
    if not _supported("torch", "torch_export_files_faster"):
        return
    from torch._export.serde import serialize  # what this patch changes

    if not isinstance(serialize.typing, _TypingWithCachedHints):
        serialize.typing = _TypingWithCachedHints()
    if not isinstance(serialize.copy, _CopyByPickle):
        serialize.copy = _CopyByPickle()
    import torch  # start-up time: patches/ is imported by every command

    # (2.8's _dict_to_dataclass is other code: it keeps its own, with the cached hints above)
    if (torch.__version__.startswith(("2.13.", "2.14."))
            and not isinstance(serialize._dict_to_dataclass, _SchemaFromJson)):
        serialize._dict_to_dataclass = _SchemaFromJson(serialize)
