"""Qwen3.5's processor for chat messages with images, without the torchvision dependency.

Qwen3.5 checkpoints name `Qwen3VLProcessor`, which holds an image processor, the tokenizer and a video processor.
transformers' video processors need torchvision (4.57 and 5.x alike), and PyPI's torchvision wheels are built
against CUDA torch: next to a CPU torch (this project's, or torch-neuronx's) they fail to import. So
`AutoProcessor.from_pretrained` of a Qwen3.5 checkpoint fails on such a machine before any image is read.

`Qwen35Processor` is the same processor for text and images: transformers' own Qwen2-VL image processor (its
Pillow form when torchvision is missing, read from the checkpoint's `preprocessor_config.json`), the checkpoint's
tokenizer and chat template, and the same prompt expansion as `Qwen3VLProcessor` (each `<|image_pad|>` becomes one
token per merged 2 x 2 patch group). Videos are refused with one line. It is a transformers `ProcessorMixin`, so
`apply_chat_template` (images inside the messages, as URLs, paths or PIL images), `batch_decode` and
`pipeline("image-text-to-text", model=..., processor=...)` work as with any processor.

Where torchvision does work, `AutoProcessor.from_pretrained(export)` gives transformers' own `Qwen3VLProcessor`:
a vision export keeps the checkpoint's processor files unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import transformers
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError
from transformers import AutoImageProcessor, AutoTokenizer
from transformers.feature_extraction_utils import BatchFeature
from transformers.image_processing_base import ImageProcessingMixin
from transformers.processing_utils import ProcessingKwargs, ProcessorMixin
from transformers.utils import is_torchvision_available

from optimum_qwen35.errors import MissingDependencyError, UsageError
from optimum_qwen35.export import layout
from optimum_qwen35.hub.download import download_checkpoint

_NO_VIDEO = (
    "videos are not supported: the Qwen3.5 export runs images only (pass images=, or frames as separate images)"
)

# The checkpoint's processor files, copied unchanged into a vision export: `AutoProcessor` (where torchvision works)
# and `Qwen35Processor` load from it.
PROCESSOR_FILES = layout.PROCESSOR_FILES


def copy_processor_files(model_id, target: str | os.PathLike, revision=None, token=None) -> None:
    """The checkpoint's processor files into a vision export (from a folder, or a Hub id downloaded for them alone)."""
    source = Path(model_id)
    if not source.is_dir():
        source = download_checkpoint(os.fspath(model_id), revision, token, allow_patterns=list(PROCESSOR_FILES))
    for name in PROCESSOR_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, Path(target) / name)


class Qwen35ProcessorKwargs(ProcessingKwargs, total=False):
    _defaults = {"text_kwargs": {"padding": False}}


# Generation options that reach a processor when given to pipeline("image-text-to-text") directly: the pipeline
# hands every keyword it does not know to the processor, which would drop them (a greedy request would sample).
GENERATION_OPTIONS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "num_beams", "repetition_penalty",
                      "eos_token_id", "pad_token_id", "streamer")


def to_rgb(image):
    """A PIL image in RGB as transformers 5 converts it: any transparency (an alpha band, or a palette or grey image
    with a transparent colour) composited onto white. transformers 4.57 drops the alpha channel instead, so the
    model would see the colours hidden under transparent pixels."""
    from PIL import Image  # noqa: PLC0415 (optional dependency: the `vision` extra)

    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def read_image(source):
    """A local image file (or an opened PIL image) decoded now, upright (EXIF), in RGB: a truncated or unreadable
    file raises `UsageError` naming it, instead of failing later inside the image processor."""
    from PIL import Image, ImageOps  # noqa: PLC0415 (optional dependency: the `vision` extra)

    name = os.fspath(source) if isinstance(source, (str, os.PathLike)) else getattr(source, "filename", "") or "an image"
    try:
        image = Image.open(source) if isinstance(source, (str, os.PathLike)) else source
        image.load()
        return to_rgb(ImageOps.exif_transpose(image))
    except OSError as error:  # UnidentifiedImageError, "image file is truncated", ...
        raise UsageError(f"{name}: not an image Pillow can read ({error}): a truncated or corrupt file?") from None


def _prepare_images(images):
    """`images=` of the processor: PIL images and local files read by `read_image`, nested lists kept."""
    from PIL import Image  # noqa: PLC0415 (optional dependency: the `vision` extra)

    if isinstance(images, (list, tuple)):
        return [_prepare_images(image) for image in images]
    if isinstance(images, Image.Image) or (isinstance(images, (str, os.PathLike)) and Path(images).is_file()):
        return read_image(images)
    return images


def _prepare_messages(conversation):
    """The chat messages with each local image file or PIL image read by `read_image` (copies; the caller's stay)."""
    from PIL import Image  # noqa: PLC0415 (optional dependency: the `vision` extra)

    if isinstance(conversation, (list, tuple)):
        return [_prepare_messages(item) for item in conversation]
    if not isinstance(conversation, dict):
        return conversation
    if conversation.get("type") == "image":
        item = dict(conversation)
        for key in ("image", "path", "url"):
            value = item.get(key)
            if isinstance(value, Image.Image) or (isinstance(value, (str, os.PathLike)) and Path(value).is_file()):
                item[key] = read_image(value)
        return item
    if isinstance(conversation.get("content"), list):
        return {**conversation, "content": _prepare_messages(conversation["content"])}
    return conversation


def _require_pillow() -> None:
    try:
        from PIL import Image  # noqa: F401, PLC0415 (optional dependency: the `vision` extra)
    except ImportError as error:
        raise MissingDependencyError(
            "the Qwen3.5 image processor needs Pillow: pip install Pillow (or pip install \"optimum-qwen35[vision]\")"
        ) from error


def _image_processor_from_pretrained(path, **kwargs):
    """The checkpoint's image processor: the torchvision form where torchvision imports, the Pillow form elsewhere,
    chosen up front so that transformers does not warn about falling back."""
    if "use_fast" not in kwargs and "backend" not in kwargs:
        if int(transformers.__version__.split(".")[0]) >= 5:
            kwargs["backend"] = "torchvision" if is_torchvision_available() else "pil"
        else:
            kwargs["use_fast"] = is_torchvision_available()
    return AutoImageProcessor.from_pretrained(path, **kwargs)


def _largest_image_bucket(path, hub_kwargs) -> int | None:
    """The largest image bucket (in patches) of a vision export: a cpu-target export names its buckets in
    `compiled/graphs.json`, a Neuron export in its config.json (`export.layout.VISION_EXPORT_KEY`). None for a
    checkpoint or a text-only export."""

    graphs = _export_file(path, f"{layout.COMPILED_DIR}/{layout.GRAPHS_FILE}", hub_kwargs)
    if graphs is not None:
        vision = json.loads(graphs.read_text()).get("vision")
        return max(vision["image_buckets"]) if vision else None
    config = _export_file(path, "config.json", hub_kwargs)
    vision = json.loads(config.read_text()).get(layout.VISION_EXPORT_KEY) if config is not None else None
    return max(vision["image_buckets"]) if vision else None


def _export_file(path, name: str, hub_kwargs) -> Path | None:
    """A file of a folder or Hub repo; None when it has none."""
    if Path(path).is_dir():
        return Path(path) / name if (Path(path) / name).is_file() else None
    try:
        return Path(hf_hub_download(str(path), name, **hub_kwargs))
    except EntryNotFoundError:
        return None


class Qwen35Processor(ProcessorMixin):
    """Text and images for Qwen3.5 (see the module docstring): `processor(text=..., images=...)` gives
    `input_ids`, `attention_mask`, `pixel_values` [patches, 3 * 2 * 16 * 16] and `image_grid_thw` [images, 3],
    the inputs of `generate(...)` of a vision export."""

    attributes = ["image_processor", "tokenizer"]
    image_processor_class = "AutoImageProcessor"
    tokenizer_class = "AutoTokenizer"

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, chat_template=chat_template)
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        if self.image_token_id is None or self.image_token_id == tokenizer.unk_token_id:
            raise UsageError(f"the tokenizer has no {self.image_token} token: it is not a Qwen3.5 tokenizer")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        """From a checkpoint or a vision export (a folder or a Hub id): its `preprocessor_config.json`, tokenizer
        and chat template."""
        _require_pillow()
        hub_kwargs = {k: kwargs.pop(k) for k in ("revision", "token", "cache_dir", "local_files_only") if k in kwargs}
        try:
            config, _ = ImageProcessingMixin.get_image_processor_dict(pretrained_model_name_or_path, **hub_kwargs)
        except OSError as error:
            raise UsageError(
                f"{pretrained_model_name_or_path} has no preprocessor_config.json: it is not a Qwen3.5 checkpoint "
                "or vision export (a text-only export carries no image processor; export with vision=True)"
            ) from error
        # The pixel bounds, passed explicitly: transformers 4.57's Pillow-form Qwen2-VL processor replaces the
        # file's `size` by its own defaults (1M pixels at most where Qwen3.5 says 16M; 3136 at least where it
        # says 65536), which would resize images differently from transformers' other form.
        size = config.get("size") or {}
        bounds = {"min_pixels": size.get("shortest_edge"), "max_pixels": size.get("longest_edge")}
        # A vision export runs images of up to its largest image bucket: resize larger ones down to it (rather
        # than refusing them at generate()).
        largest_bucket = _largest_image_bucket(pretrained_model_name_or_path, hub_kwargs)
        if largest_bucket is not None:
            cap = largest_bucket * config.get("patch_size", 16) ** 2
            bounds["max_pixels"] = min(bounds["max_pixels"] or cap, cap)
        kwargs = {**{k: v for k, v in bounds.items() if v is not None}, **kwargs}
        image_processor = _image_processor_from_pretrained(pretrained_model_name_or_path, **hub_kwargs, **kwargs)
        if getattr(image_processor, "max_pixels", None) is not None:  # the form that reads min/max_pixels: say so
            image_processor.size = {"shortest_edge": image_processor.min_pixels, "longest_edge": image_processor.max_pixels}
        tokenizer = AutoTokenizer.from_pretrained(pretrained_model_name_or_path, **hub_kwargs)
        return cls(image_processor, tokenizer, chat_template=getattr(tokenizer, "chat_template", None))

    def __call__(self, images=None, text=None, videos=None, audio=None, **kwargs):
        if videos is not None or audio is not None:
            raise UsageError(_NO_VIDEO)
        misplaced = sorted(k for k in kwargs if k in GENERATION_OPTIONS)
        if misplaced:
            raise UsageError(
                f"{', '.join(misplaced)} reached the processor: give generation options to the image-text-to-text "
                f"pipeline as generate_kwargs={{{misplaced[0]!r}: ...}} (only max_new_tokens is taken directly)"
            )
        if text is None:
            raise UsageError("text is required: the prompt holds one <|image_pad|> per image, where it goes")
        # Sort the keyword arguments out for the image processor and the tokenizer, as transformers' processors do.
        kwargs = self._merge_kwargs(Qwen35ProcessorKwargs, tokenizer_init_kwargs=self.tokenizer.init_kwargs, **kwargs)
        return_tensors = kwargs["text_kwargs"].pop("return_tensors", None)
        texts = [text] if isinstance(text, str) else list(text)
        image_inputs = {}
        if images is not None:
            images = _prepare_images(images)
            image_inputs = self.image_processor(images=images, **kwargs["images_kwargs"])
            texts = self._expand_image_tokens(texts, image_inputs["image_grid_thw"])
        elif any(self.image_token in t for t in texts):
            raise UsageError(f"the text holds {self.image_token} but no images were given")
        text_inputs = self.tokenizer(texts, **kwargs["text_kwargs"])
        return BatchFeature(data={**text_inputs, **image_inputs}, tensor_type=return_tensors)

    def apply_chat_template(self, conversation, chat_template=None, **kwargs):
        """transformers' (images inside the messages are read here), with an unreadable image file as one line."""
        from PIL import UnidentifiedImageError  # noqa: PLC0415 (optional dependency: the `vision` extra)

        conversation = _prepare_messages(conversation)
        try:
            return super().apply_chat_template(conversation, chat_template, **kwargs)
        except UnidentifiedImageError as error:
            raise UsageError(f"{error}: not an image Pillow can read (a corrupt file, or not an image)") from None

    def _expand_image_tokens(self, texts, image_grid_thw):
        """One `<|image_pad|>` per image becomes one per merged token: t * h * w / merge_size**2."""
        per_image = (torch.as_tensor(image_grid_thw).prod(-1) // self.image_processor.merge_size**2).tolist()
        found = sum(t.count(self.image_token) for t in texts)
        if found != len(per_image):
            raise UsageError(
                f"the text holds {found} {self.image_token} token(s) for {len(per_image)} image(s): one per image "
                "(the chat template writes it for each image of the messages)"
            )
        images = iter(per_image)
        expanded = []
        for text in texts:
            parts = text.split(self.image_token)
            out = parts[0]
            for part in parts[1:]:
                out += self.image_token * next(images) + part
            expanded.append(out)
        return expanded

    @property
    def model_input_names(self):
        """What `__call__` returns: the tokenizer's inputs, then the images' (no video inputs: videos are refused)."""
        return [*self.tokenizer.model_input_names, "pixel_values", "image_grid_thw"]

