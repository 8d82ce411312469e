"""A sharded export: one safetensors file per tensor-parallel rank, written and read whole.

`save_sharded` writes one safetensors file per rank, `rank_{r}.safetensors`, next to a copy of `config.json`, and a
manifest `tp_shards.json` written last: a folder without the manifest is an incomplete export and is refused by
`load_sharded`. How each tensor is split is checkpoint/shard.py's.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from .. import validation
from ..config import Qwen35Config
from ..errors import IncompatibleExportError, UsageError
from ..export import layout
from ..export.layout import rank_file
from ..export.writer import copy_side_files, output_folder
from .convert import (
    CheckpointError,
    check_checkpoint,
    check_finite,
    convert_checkpoint,
    convert_mtp,
    decoder_name,
    expected_shapes,
    stored_dtype,
)
from .fp8 import FP8_DTYPE
from .fp8_shard import SCALE_SUFFIX, check_fp8_shard_shapes, fp8_rank_tensors
from .reader import SAFETENSORS_DTYPES, CheckpointReader
from .shard import MANIFEST, MANIFEST_FORMAT, MANIFEST_VERSION, shard_tensor, sharded_shapes, tp_layout

_DTYPE_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}


class StreamingSafetensorsWriter:
    """Writes a safetensors file tensor by tensor: the header (all names, dtypes, shapes) goes first,
    so that no tensor has to be held until the end. Written under a temporary name, renamed on `commit`.
    """

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str]):
        self.path, self.tmp = path, path.with_name(f".{path.name}.tmp-{os.getpid()}")
        header: dict[str, object] = {"__metadata__": metadata}
        offset = 0
        self.order: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
        for name, dtype, shape in entries:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            header[name] = {"dtype": _DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self.order.append((name, dtype, tuple(shape), nbytes))
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data aligned to 8 bytes, as safetensors itself writes
        self.size = 8 + len(blob) + offset
        self.file = open(self.tmp, "wb")  # noqa: SIM115
        self.file.write(len(blob).to_bytes(8, "little") + blob)
        self.next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected, dtype, shape, nbytes = self.order[self.next]
        if name != expected or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise RuntimeError(
                f"{self.path.name}: got {name} {tensor.dtype} {tuple(tensor.shape)}, expected {expected} {dtype} {shape}"
            )
        data = tensor.contiguous().reshape(-1).view(torch.uint8)
        self.file.write(memoryview(data.numpy()))
        self.next += 1

    def commit(self) -> int:
        if self.next != len(self.order):
            raise RuntimeError(f"{self.path.name}: {len(self.order) - self.next} tensors were not written")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        if os.path.getsize(self.tmp) != self.size:
            raise RuntimeError(f"{self.path.name}: wrote {os.path.getsize(self.tmp)} bytes, expected {self.size}")
        os.replace(self.tmp, self.path)
        return self.size

    def abort(self) -> None:
        if not self.file.closed:
            self.file.close()
        self.tmp.unlink(missing_ok=True)




def _write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_sharded(
    source: CheckpointReader | str | os.PathLike,
    config: Qwen35Config | None,
    tp_degree: int,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | str | None = None,
    progress: bool = True,
    overwrite: bool = False,
    weights_dtype: str | None = None,
    e4m3_range: bool = False,
) -> Path:
    """Convert and shard a checkpoint for `tp_degree` ranks and save one safetensors file per rank.

    Output folder: `config.json` (the source's, unchanged), the tokenizer files if the source has them, `rank_{r}.safetensors` for r in 0..t-1
    (decoder parameter names, each rank's shard, tied lm_head omitted), and `tp_shards.json` (written
    last; without it the folder is an incomplete export). Each source tensor is read once and its t
    shards are streamed into the t files, so memory holds about one source tensor at a time.

    The folder is written whole or not at all (`output.output_folder`): built in a hidden sibling and
    renamed into place when complete. An `out_dir` holding a model or an export is refused unless
    `overwrite=True`, and then replaced whole (no stale rank files); the source folder is refused.
    Everything is checked before anything is written.

    `weights_dtype="fp8"` (a block-FP8 checkpoint): the FP8 weights stay float8, each beside its expanded scale
    `<name>_scale` (checkpoint/fp8_shard.py), as `load_decoder(weights_dtype="fp8")` holds them; the manifest says
    `"weights_dtype": "fp8"`. Each rank's file is then built whole in memory (one rank's weights at a time).
    `e4m3_range` (with it): the float8 weights fitted to float8_e4m3's range, as trn2 computes FP8 E4M3
    (`fp8.fit_e4m3_range`).
    """
    if not isinstance(source, CheckpointReader):
        source = validation.model_folder(source, "shard")
        if is_sharded_export(source):
            raise UsageError(
                f"{source} is a sharded export (it has {MANIFEST} or rank files), not a checkpoint: shard the original "
                "checkpoint folder instead"
            )
    dtype = None if dtype is None else validation.parse_dtype(dtype)
    reader = source if isinstance(source, CheckpointReader) else CheckpointReader(source, dequantize_dtype=dtype)
    config = config or Qwen35Config.from_pretrained(reader.folder)
    config.check_tp_degree(tp_degree)
    check_checkpoint(reader, config)
    if weights_dtype is not None and weights_dtype != "fp8":
        raise UsageError(f"weights_dtype {weights_dtype!r} is not supported: 'fp8' (keep FP8 weights) or None (the model dtype)")
    if weights_dtype == "fp8" and reader.fp8_block is None:
        raise UsageError(f"{reader.folder} holds no FP8 weights (no quantization_config): quantize it first or save it without weights_dtype")
    with output_folder(out_dir, sources=[reader.folder], overwrite=overwrite) as tmp:
        if weights_dtype == "fp8":
            _write_fp8_shards(reader, config, tp_degree, tmp, dtype, e4m3_range)
        else:
            _write_shards(reader, config, tp_degree, tmp, dtype, progress)
    return Path(out_dir).expanduser()


def _write_shards(reader: CheckpointReader, config: Qwen35Config, tp_degree: int, out: Path, dtype, progress: bool) -> None:
    """Write the export into the (new, empty) folder `out`; the manifest last."""
    shapes = sharded_shapes(config, tp_degree)
    source_names = list(expected_shapes(config))
    dtypes = {decoder_name(n): stored_dtype(n, dtype) or reader.dtype(n) for n in source_names}
    entries = [(name, dtypes[name], shapes[name]) for name in shapes]
    writers = [
        StreamingSafetensorsWriter(
            out / layout.rank_file(r), entries, {"format": "pt", "tp_degree": str(tp_degree), "rank": str(r)}
        )
        for r in range(tp_degree)
    ]
    try:
        with open(out / f".{layout.CONFIG_FILE}.tmp", "w", encoding="utf-8") as f:
            json.dump(config.raw or config.to_text_dict(), f, indent=2)
        os.replace(out / f".{layout.CONFIG_FILE}.tmp", out / layout.CONFIG_FILE)
        copy_side_files(reader.folder, out)
        bar = _progress(total=sum(reader_nbytes(reader, n) for n in source_names), enabled=progress, desc=f"shard TP={tp_degree}")
        for source_name, (name, tensor) in zip(source_names, convert_checkpoint(reader, config)):
            check_finite({name: tensor}, str(reader.folder))  # an export never carries NaN or Inf weights
            laid_out, dim = tp_layout(name, tensor, config, tp_degree)
            for rank, writer in enumerate(writers):
                shard = laid_out if dim is None else laid_out.chunk(tp_degree, dim)[rank]
                writer.write(name, shard.to(dtypes[name]))
            bar.update(reader_nbytes(reader, source_name))
            del tensor, laid_out
        bar.close()
        files = []
        for rank, writer in enumerate(writers):
            files.append({"rank": rank, "file": layout.rank_file(rank), "bytes": writer.commit()})
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    _write_manifest(out, reader, config, tp_degree, set(dtypes.values()), files)


def _write_manifest(out: Path, reader: CheckpointReader, config: Qwen35Config, tp_degree: int, dtypes: set,
                    files: list[dict], weights_dtype: str | None = None) -> None:
    _write_json_atomic(
        out / MANIFEST,
        {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "tp_degree": tp_degree,
            "dtype": sorted({_DTYPE_CODES[d] for d in dtypes}),
            "tie_word_embeddings": config.tie_word_embeddings,
            **({"moe_parallel": config.expert_parallel_mode(tp_degree)} if config.is_moe else {}),
            **({"weights_dtype": weights_dtype} if weights_dtype else {}),
            "source": str(reader.folder),
            "files": files,
        },
    )


def _write_fp8_shards(reader: CheckpointReader, config: Qwen35Config, tp_degree: int, out: Path, dtype,
                      e4m3_range: bool = False) -> None:
    """`_write_shards` with the FP8 weights kept as float8 and their scales beside them; one rank at a time."""
    with open(out / f".{layout.CONFIG_FILE}.tmp", "w", encoding="utf-8") as f:
        json.dump(config.raw or config.to_text_dict(), f, indent=2)
    os.replace(out / f".{layout.CONFIG_FILE}.tmp", out / layout.CONFIG_FILE)
    copy_side_files(reader.folder, out)
    files, dtypes = [], set()
    for rank in range(tp_degree):
        tensors = fp8_rank_tensors(reader, config, tp_degree, rank, dtype, e4m3_range=e4m3_range)
        check_finite(tensors, str(reader.folder))
        dtypes |= {t.dtype for t in tensors.values()}
        file = out / layout.rank_file(rank)
        tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}")
        save_file(tensors, os.fspath(tmp), metadata={"format": "pt", "tp_degree": str(tp_degree), "rank": str(rank)})
        os.replace(tmp, file)
        files.append({"rank": rank, "file": layout.rank_file(rank), "bytes": file.stat().st_size})
        del tensors
    _write_manifest(out, reader, config, tp_degree, dtypes, files, "fp8")


def reader_nbytes(reader: CheckpointReader, name: str) -> int:
    return torch.Size(reader.shape(name)).numel() * reader.dtype(name).itemsize


def _progress(total: int, enabled: bool, desc: str):
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not enabled)


# ------------------------------------------------------------------------------------------ loading exports
def is_sharded_export(path: str | os.PathLike) -> bool:
    """True when `path` is a folder written by `save_sharded` (complete or not)."""
    path = Path(path)
    return (path / MANIFEST).is_file() or any(path.glob("rank_*.safetensors"))


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of a complete export; a clear error for an incomplete or foreign folder."""
    path = Path(path)
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointError(
            f"{path} has no {MANIFEST}: it is not a complete sharded export (an interrupted save_sharded leaves "
            "no manifest); export it again"
        )
    try:
        manifest = json.loads(file.read_text())
    except ValueError as e:
        raise CheckpointError(f"{file} is not valid JSON ({e}): the export is damaged; export it again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT or manifest.get("version") != MANIFEST_VERSION:
        raise CheckpointError(f"{file} is not a {MANIFEST_FORMAT} v{MANIFEST_VERSION} manifest")
    for entry in manifest["files"]:
        f = path / entry["file"]
        if not f.is_file() or f.stat().st_size != entry["bytes"]:
            raise CheckpointError(f"{f} is missing or has the wrong size ({entry['bytes']} bytes expected)")
    return manifest


def load_sharded(
    path: str | os.PathLike,
    rank: int,
    tp_degree: int | None = None,
    dtype: torch.dtype | None = None,
    check_weights: bool = True,
) -> tuple[Qwen35Config, int, dict[str, torch.Tensor]]:
    """Read one rank's shard of a `save_sharded` export: (config, tp_degree, {decoder name: tensor}).

    Weights holding NaN or Inf (a file damaged after the export) are refused, naming the tensor."""
    path = Path(path)
    manifest = read_manifest(path)
    saved_degree = manifest["tp_degree"]
    if tp_degree is not None and tp_degree != saved_degree:
        raise IncompatibleExportError(
            f"{path} holds shards for tensor_parallel_size={saved_degree}, not {tp_degree}; use "
            f"tensor_parallel_size={saved_degree} or export it again for {tp_degree}"
        )
    if not 0 <= rank < saved_degree:
        raise UsageError(f"rank {rank} is outside 0..{saved_degree - 1}")
    config = Qwen35Config.from_pretrained(path)
    if "moe_parallel" in manifest:  # how this export split the experts
        config = dataclasses.replace(config, moe_parallel=manifest["moe_parallel"])
    tensors = load_file(path / layout.rank_file(rank))
    expected = sharded_shapes(config, saved_degree)
    fp8 = manifest.get("weights_dtype") == "fp8"  # float8 weights with their scales (save_sharded weights_dtype="fp8")
    got = {n: tuple(t.shape) for n, t in tensors.items() if not (fp8 and n.endswith(SCALE_SUFFIX))}
    wrong_scales = check_fp8_shard_shapes(tensors) if fp8 else []
    if wrong_scales:
        raise CheckpointError(f"{path / layout.rank_file(rank)}: FP8 scales that do not fit their weights: {wrong_scales[:5]}; export it again")
    if got != expected:
        missing = sorted(set(expected) - set(got))
        wrong = sorted(n for n in set(expected) & set(got) if expected[n] != got[n])
        raise CheckpointError(
            f"{path / layout.rank_file(rank)} does not match config.json: missing {missing}, "
            f"unexpected {sorted(set(got) - set(expected))}, wrong shape {wrong}"
        )
    if check_weights:
        check_finite(tensors, str(path / layout.rank_file(rank)))
    if dtype is not None:  # (float8 weights and their float32 scales stay as stored)
        tensors = {n: t if t.dtype == FP8_DTYPE or (fp8 and n.endswith(SCALE_SUFFIX)) else t.to(stored_dtype(n, dtype))
                   for n, t in tensors.items()}
    return config, saved_degree, tensors



# ------------------------------------------------------------------- the MTP head of an export made with mtp=True
def save_mtp_weights(source: str | os.PathLike, config: Qwen35Config, dtype: torch.dtype, out_dir: str | os.PathLike,
                     tp_degree: int = 1) -> list[Path]:
    """The multi-token-prediction head's converted weights (`mtp.*` decoder names, checkpoint/convert.py
    `convert_mtp`), each rank's share (sharded as the main layers: checkpoint/shard.py) in
    `out_dir/<layout.mtp_weights_file(rank, tp_degree)>`, beside the rank's weights. The head is converted once."""
    whole = dict(convert_mtp(CheckpointReader(source, mtp=True, dequantize_dtype=dtype), config, dtype))
    check_finite(whole, str(source))
    files = []
    for rank in range(tp_degree):
        tensors = {name: shard_tensor(name, t, config, tp_degree, rank).to(memory_format=torch.contiguous_format, copy=True)
                   for name, t in whole.items()}
        file = Path(out_dir) / layout.mtp_weights_file(rank, tp_degree)
        tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}")
        save_file(tensors, os.fspath(tmp), metadata={"format": "pt"})
        os.replace(tmp, file)
        files.append(file)
    return files


def load_mtp_weights(path: str | os.PathLike, dtype: torch.dtype | None = None, rank: int = 0,
                     tp_degree: int = 1) -> dict[str, torch.Tensor]:
    """Rank `rank`'s share of the head of a sharded export made with mtp=True (`save_mtp_weights`); a one-line
    error without."""
    file = Path(path) / layout.mtp_weights_file(rank, tp_degree)
    if not file.is_file():
        raise IncompatibleExportError(
            f"{path} has no {file.name}: this export has no multi-token-prediction head for rank {rank} of "
            f"{tp_degree}; export the model with mtp=True"
        )
    tensors = load_file(file)
    check_finite(tensors, str(file))
    return tensors if dtype is None else {n: t.to(stored_dtype(n, dtype)) for n, t in tensors.items()}
