"""Images in, on the CPU target: the vision tower's graph per image bucket, then the decoder's image graphs.

    model = Qwen35ForImageTextToText.from_pretrained("path/to/Qwen3.5-checkpoint", max_length=1024)
    inputs = processor(text=[prompt], images=[image], return_tensors="pt")
    tokens = model.generate([inputs["input_ids"][0].tolist()], 32, pixel_values=inputs["pixel_values"],
                            image_grid_thw=inputs["image_grid_thw"])

An image runs alone in the smallest *image bucket* (a static number of patch rows, `image_buckets`) that holds its
patches; an image with more patches than the largest bucket is refused before anything runs. Its merged tokens
replace the prompt's `<|image_pad|>` tokens, and the prompt's 3-D rotary positions are computed on the host
(`modeling.vision.rope_index`, as transformers' `get_rope_index`). Text-only prompts run exactly the text
graphs of `Qwen35ForCausalLM`.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .. import validation
from ..checkpoint import CheckpointReader
from ..checkpoint.convert import check_finite
from ..config import Qwen35Config
from ..errors import CheckpointError, UnsupportedModelError, UsageError
from ..modeling.vision import (
    VisionConfig,
    VisionEncoder,
    convert_vision_tensor,
    expected_vision_shapes,
    image_bucket_inputs,
    rope_index,
)
from .cpu import Qwen35ForCausalLM, load_decoder

# Patch rows per image bucket (16 x 16-pixel patches): 256 holds a 256 x 256 image, 1024 a 512 x 512 one,
# 4096 a 1024 x 1024 one.
DEFAULT_IMAGE_BUCKETS = (256, 1024, 4096)


@dataclass
class ImagePrompt:
    """What the decoder needs of one prompt holding images (`Qwen35ForCausalLM.prefill`'s `images` entries)."""

    rope_positions: torch.Tensor  # [3, L] int64: time, row, column of each token
    embeds: torch.Tensor  # [L, hidden]: the image tokens' embeddings (zeros at text tokens)
    mask: torch.Tensor  # [L] bool: which tokens are image tokens
    rope_delta: int  # generated token at position p rotates as p + rope_delta


def load_vision_encoder(path: str | os.PathLike, vision: VisionConfig, dtype: torch.dtype | str = torch.float32,
                        check_weights: bool = True) -> VisionEncoder:
    """Build the vision tower (tp_degree 1) and load its weights from a checkpoint folder."""
    dtype = validation.parse_dtype(dtype)
    reader = CheckpointReader(path)
    expected = expected_vision_shapes(vision)
    present = set(reader.vision_names())
    missing = sorted(set(expected) - present)
    wrong = sorted(n for n in set(expected) & present if reader.vision_shape(n) != expected[n])
    if missing or wrong:
        details = [f"missing {missing[:10]}"] if missing else []
        details += [f"wrong shape {wrong[:10]}"] if wrong else []
        raise CheckpointError(f"{path}: the vision tower's weights do not match its config.json: {'; '.join(details)}")
    params = {}
    for name in expected:
        for key, tensor in convert_vision_tensor(name, reader.get_vision(name)).items():
            params[key] = tensor.to(dtype)
    if check_weights:
        check_finite(params, f"{path} (vision tower)")
    with torch.device("meta"):
        encoder = VisionEncoder(vision)
    result = encoder.load_state_dict(params, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(
            f"{path}: vision weights do not match: missing {result.missing_keys}, unexpected {result.unexpected_keys}"
        )
    encoder.rotary.inv_freq = encoder.rotary.inv_freq.float()
    return encoder.eval()


class ImageInputs:
    """What takes images, over any runtime with the image graphs (`_run_image_context`, `_run_image_token`):
    the checks, the vision tower's calls (`_run_vision`), the placement of its tokens, `logits` and `generate`.
    Needs `vision_config` and `image_buckets`."""

    vision_config: VisionConfig
    image_buckets: list[int]

    def _set_image_buckets(self, image_buckets: Sequence[int]) -> None:
        unit = self.vision_config.merge_unit
        if isinstance(image_buckets, (str, bytes)) or not isinstance(image_buckets, Sequence):
            raise UsageError(f"image_buckets must be a list of patch counts, got {type(image_buckets).__name__}")
        image_buckets = sorted({validation.positive_int(b, "each image bucket") for b in image_buckets})
        if not image_buckets or any(b % unit for b in image_buckets):
            raise UsageError(f"image_buckets must be patch counts, multiples of {unit}, got {image_buckets}")
        self.image_buckets = image_buckets

    def _run_vision(self, bucket: int, *inputs: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # ------------------------------------------------------------------ vision
    def image_bucket_for(self, patches: int) -> int:
        """The smallest image bucket holding `patches` patch rows; an image past the largest is refused."""
        i = bisect.bisect_left(self.image_buckets, patches)
        if i == len(self.image_buckets):
            raise UsageError(
                f"an image of {patches} patches is larger than the largest image bucket ({self.image_buckets[-1]} "
                f"patches, buckets {self.image_buckets}); resize it smaller (processor max_pixels) or add a bucket"
            )
        return self.image_buckets[i]

    def check_images(self, input_ids: Sequence[Sequence[int]], pixel_values, image_grid_thw) -> list[list[int]]:
        """Check that the images match the prompts (before anything runs); returns each image's (t, h, w)."""
        v = self.vision_config
        grids = self._check_grids(pixel_values, image_grid_thw)
        # Each run of image tokens is one image, in order: its length must be that image's merged token count.
        runs = []
        for p in input_ids:
            run = 0
            for x in list(p) + [None]:
                if x == v.image_token_id:
                    run += 1
                elif run:
                    runs.append(run)
                    run = 0
        expected = [t * h * w // v.merge_unit for t, h, w in grids]
        if runs != expected:
            raise UsageError(
                f"the prompts hold image tokens in runs of {runs}, but image_grid_thw {grids} gives {expected}; "
                "build the prompt and the images with the same processor call"
            )
        return grids

    def _check_grids(self, pixel_values, image_grid_thw) -> list[list[int]]:
        """Check image_grid_thw, pixel_values against it and every image against the buckets."""
        v = self.vision_config
        grids = [] if image_grid_thw is None else [[int(x) for x in g] for g in torch.as_tensor(image_grid_thw).reshape(-1, 3)]
        if image_grid_thw is not None and torch.as_tensor(image_grid_thw).shape[-1:] != (3,):
            raise UsageError(f"image_grid_thw must be [images, 3] (t, h, w), got shape {tuple(torch.as_tensor(image_grid_thw).shape)}")
        if (pixel_values is None) != (image_grid_thw is None):
            raise UsageError("pass pixel_values and image_grid_thw together (both from the processor)")
        for t, h, w in grids:
            if t != 1 or h <= 0 or w <= 0 or h % v.spatial_merge_size or w % v.spatial_merge_size:
                raise UsageError(
                    f"image_grid_thw row {[t, h, w]} is not an image grid (t must be 1, h and w positive multiples of "
                    f"{v.spatial_merge_size}); pass the processor's image_grid_thw"
                )
        rows = sum(t * h * w for t, h, w in grids)
        if pixel_values is not None:
            shape = tuple(torch.as_tensor(pixel_values).shape)
            if len(shape) != 2 or shape != (rows, v.patch_dim):
                raise UsageError(
                    f"pixel_values has shape {shape}, but image_grid_thw {grids} needs ({rows}, {v.patch_dim}); pass the "
                    "processor's pixel_values and image_grid_thw together"
                )
        for t, h, w in grids:
            self.image_bucket_for(t * h * w)
        return grids

    @torch.no_grad()
    def image_features(self, pixel_values: torch.Tensor, image_grid_thw) -> list[torch.Tensor]:
        """The merged image tokens [h * w / merge^2, hidden] of each image (one vision graph call per image)."""
        grids = self._check_grids(pixel_values, image_grid_thw)
        features, row = [], 0
        for t, h, w in grids:
            n = t * h * w
            bucket = self.image_bucket_for(n)
            inputs = image_bucket_inputs(self.vision_config, pixel_values[row : row + n], (t, h, w), bucket)
            merged = self._run_vision(bucket, *inputs)
            features.append(merged[: n // self.vision_config.merge_unit])
            row += n
        return features

    def image_prompts(self, input_ids: Sequence[Sequence[int]], pixel_values, image_grid_thw) -> list[ImagePrompt | None]:
        """Run the vision tower and place its tokens: one `ImagePrompt` per prompt holding images, None otherwise.
        The images are taken in order, prompt after prompt."""
        grids = self.check_images(input_ids, pixel_values, image_grid_thw)
        if not grids:
            return [None] * len(input_ids)
        features = iter(self.image_features(pixel_values, image_grid_thw))
        grid_iter = iter(grids)
        out = []
        v = self.vision_config
        for p in input_ids:
            ids = torch.as_tensor(list(p), dtype=torch.int64)
            mask = ids == v.image_token_id
            if not bool(mask.any()):
                out.append(None)
                continue
            own_grids, own_features, count = [], [], 0
            while count < int(mask.sum()):
                g = next(grid_iter)
                own_grids.append(g)
                own_features.append(next(features))
                count += own_features[-1].shape[0]
            positions, delta = rope_index(v, ids, own_grids)
            embeds = torch.zeros(len(ids), self.config.hidden_size, dtype=own_features[0].dtype)
            embeds[mask] = torch.cat(own_features)
            out.append(ImagePrompt(positions, embeds, mask, delta))
        return out

    # ------------------------------------------------------------------ user-level calls
    def logits(self, prompts, pixel_values=None, image_grid_thw=None) -> list[torch.Tensor]:
        """Teacher-forced logits at every position of each prompt (its images given in order)."""
        prompts = validation.token_ids(prompts, self.config.vocab_size, allow_no_prompt=True)
        for p in prompts:
            self._check_length(len(p))
        return super().logits(prompts, images=self.image_prompts(prompts, pixel_values, image_grid_thw))

    def generate(self, prompts, max_new_tokens: int = 32, eos_token_id=None, streamer=None, sampler=None,
                 pixel_values=None, image_grid_thw=None, stop=None, min_new_tokens: int = 0) -> list[list[int]]:
        """`Qwen35ForCausalLM.generate` of prompts holding images: `pixel_values` [patches, patch_dim] and
        `image_grid_thw` [images, 3] as the processor returns them, the images in prompt order."""
        prompts = validation.token_ids(prompts, self.config.vocab_size, allow_no_prompt=True)
        self._new_token_limits(prompts, max_new_tokens)  # the length errors come before the vision tower runs
        images = self.image_prompts(prompts, pixel_values, image_grid_thw)
        return super().generate(prompts, max_new_tokens, eos_token_id, streamer, sampler, images=images, stop=stop,
                                min_new_tokens=min_new_tokens)


class Qwen35ForImageTextToText(ImageInputs, Qwen35ForCausalLM):
    """`Qwen35ForCausalLM` with the vision tower: `logits` and `generate` take images (CPU, eager, static shapes)."""

    def __init__(self, decoder, vision: VisionEncoder, batch_size: int = 1, max_length: int = 1024, buckets=None,
                 image_buckets: Sequence[int] = DEFAULT_IMAGE_BUCKETS, trace: bool = False, pack_weights: bool = False):
        super().__init__(decoder, batch_size, max_length, buckets, trace, pack_weights)
        self.vision = vision
        self.vision_config = vision.config
        self._set_image_buckets(image_buckets)

    @classmethod
    def from_pretrained(cls, path, batch_size: int = 1, max_length: int = 1024, dtype=torch.float32, buckets=None,
                        image_buckets: Sequence[int] = DEFAULT_IMAGE_BUCKETS, trace: bool = False,
                        pack_weights: bool = True) -> "Qwen35ForImageTextToText":
        """Load a checkpoint folder holding the vision tower; the decoder's linears prepacked for the CPU GEMM unless
        `pack_weights=False`, as `Qwen35ForCausalLM.from_pretrained`."""
        path = validation.model_folder(path, "Qwen35ForImageTextToText.from_pretrained")
        config = Qwen35Config.from_pretrained(path)
        vision = VisionConfig.from_dict(config.raw)
        if vision is None:
            raise UnsupportedModelError(f"{path} has no vision tower (a text-only config); load it with Qwen35ForCausalLM")
        decoder = load_decoder(path, dtype, config=config)
        return cls(decoder, load_vision_encoder(path, vision, dtype), batch_size, max_length, buckets, image_buckets,
                   trace, pack_weights)

    def _run_vision(self, bucket: int, *inputs: torch.Tensor) -> torch.Tensor:
        return self.vision(*inputs)


__all__ = ["DEFAULT_IMAGE_BUCKETS", "ImageInputs", "ImagePrompt", "Qwen35ForImageTextToText", "load_vision_encoder"]
