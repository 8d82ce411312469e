"""Speculative decoding on a cpu export made with mtp=True (export/compile.py `speculative_plan`, runtime/exported.py
`SpeculativePrograms`) is exact: greedy, token for token what plain greedy decoding on the same export returns, for
k = 1..4, fp32 and bf16, a batch of two rows that accept different numbers of drafts (the head fitted to tiny-2b,
optimum_qwen35/tiny/mtp_fit.py: one row in-sample, where it accepts, one not, where it accepts almost nothing)."""

import json
import shutil

import pytest
import torch

from optimum_qwen35.errors import IncompatibleExportError, UsageError
from optimum_qwen35.export.layout import COMPILED_DIR, GRAPHS_FILE
from optimum_qwen35.runtime import Qwen35Runtime

NEW = 40


@pytest.fixture(scope="module")
def fitted(fitted_tiny_2b):
    return fitted_tiny_2b


# bf16 at TP 1 is a matrix point: the TP 2 bf16 test below runs bf16 speculation on an export; fp32 holds the tighter
# check, and the EOS and refusal tests do not depend on the dtype.
@pytest.fixture(scope="module", params=[torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.matrix)],
                ids=["fp32", "bf16"])
def export(request, fitted, tmp_path_factory):
    from tests.kit.mtp_export import mtp_export

    return mtp_export(fitted, tmp_path_factory.mktemp("export"), request.param)


def test_greedy_speculation_on_an_export_equals_greedy_decoding(fitted, export):
    manifest = json.loads((export / COMPILED_DIR / GRAPHS_FILE).read_text())
    assert manifest["mtp"]["max_speculative_tokens"] == 4 and manifest["mtp"]["files"] == ["mtp.safetensors"]
    model = Qwen35Runtime.from_export(export)
    assert model.graphs.has_mtp
    # Row 0: a prompt the head was fitted on and the start of its greedy continuation (in-sample); row 1: not.
    fitted_prompt = json.loads((fitted / "mtp_fit.json").read_text())["prompts"][0]
    prompts = [fitted_prompt + model.generate([fitted_prompt], max_new_tokens=9)[0], [7, 300, 2] * 5 + [11, 12]]
    plain = model.generate(prompts, max_new_tokens=NEW)
    bf16 = manifest["dtype"] == "bfloat16"
    lengths = {}
    for k in (1, 2, 3, 4):
        assert model.generate(prompts, max_new_tokens=NEW, num_speculative_tokens=k) == plain, f"k={k}"
        stats = model.speculation
        lengths[k] = stats.acceptance_length
        # bf16's greedy continuation leaves fp32's, which the head was fitted on, after a few tokens: it accepts
        # little (measured 1.04 at k = 1), but some drafts, so that accepted drafts are part of what is compared.
        assert stats.accepted > 0 and stats.acceptance_length > (1.0 if bf16 else 1.3), (k, stats.accepted_per_round)
        # The rounds where both rows ran (the first entries, two per round): the rows accepted different numbers.
        pairs = list(zip(stats.accepted_per_round[0::2], stats.accepted_per_round[1::2]))
        assert any(a != b for a, b in pairs), (k, pairs)
    print(f"acceptance length per k on the export ({manifest['dtype']}): {lengths}")
    model.close()


def test_eos_and_the_end_of_the_cache_on_an_export(fitted, export):
    """The padded verify and catch-up programs at the end of the cache (the verified length cut to what fits, the
    padding past max_length) and an EOS inside accepted drafts: the plain greedy tokens."""
    model = Qwen35Runtime.from_export(export)
    fitted_prompt = json.loads((fitted / "mtp_fit.json").read_text())["prompts"][0]
    prompts = [fitted_prompt + model.generate([fitted_prompt], max_new_tokens=22)[0], [7, 300, 2] * 5 + [11, 12]]
    longest = model.max_length - len(prompts[0])  # row 0 generates up to the last cache position
    plain = model.generate(prompts, max_new_tokens=longest)
    assert model.generate(prompts, max_new_tokens=longest, num_speculative_tokens=4) == plain
    eos = plain[0][NEW // 2]
    want = model.generate(prompts, max_new_tokens=NEW, eos_token_id=eos)
    assert len(want[0]) <= NEW // 2 + 1
    assert model.generate(prompts, max_new_tokens=NEW, eos_token_id=eos, num_speculative_tokens=3) == want
    model.close()


def test_speculation_needs_an_export_with_the_mtp_graphs(tmp_path, export):
    model = Qwen35Runtime.from_export(export)
    with pytest.raises(UsageError, match="at most 4 drafts per round"):
        model.generate([[1, 2, 3]], max_new_tokens=4, num_speculative_tokens=5)
    model.close()
    # A copy without the "mtp" entry (what an export made without mtp=True holds): one line saying how to fix it.
    copy = tmp_path / "export"
    shutil.copytree(export, copy)
    manifest = json.loads((copy / COMPILED_DIR / GRAPHS_FILE).read_text())
    del manifest["mtp"]
    (copy / COMPILED_DIR / GRAPHS_FILE).write_text(json.dumps(manifest))
    model = Qwen35Runtime.from_export(copy)
    with pytest.raises(IncompatibleExportError, match="export the model with mtp=True") as error:
        model.generate([[1, 2, 3]], max_new_tokens=4, num_speculative_tokens=2)
    assert "\n" not in str(error.value)
    model.close()


def _rows(fitted, model, continued: int = 9) -> list[list[int]]:
    """Row 0 in-sample (a prompt the head was fitted on and the start of its greedy continuation), row 1 not."""
    fitted_prompt = json.loads((fitted / "mtp_fit.json").read_text())["prompts"][0]
    return [fitted_prompt + model.generate([fitted_prompt], max_new_tokens=continued)[0], [7, 300, 2] * 5 + [11, 12]]


# fp32 (which also holds TP 2 to the TP 1 export's tokens) is a matrix point: TP 1 = TP 2 is tests/test_tensor_parallel.py's.
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.matrix), torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_speculation_on_a_tensor_parallel_export_equals_greedy_decoding(fitted, tmp_path, dtype):
    """An export made with mtp=True at tensor_parallel_size 2: each rank's share of the head in its own file, the
    programs run by two worker processes over gloo (runtime/worker_pool.py, speculative steps on every rank). Greedy
    speculation equals plain greedy on it for k = 1..4; in fp32 both equal the TP 1 export's tokens too."""
    from tests.kit.mtp_export import mtp_export

    folder = mtp_export(fitted, tmp_path / "tp2", dtype, tp_degree=2)
    manifest = json.loads((folder / COMPILED_DIR / GRAPHS_FILE).read_text())
    assert manifest["mtp"]["files"] == ["mtp_rank_0.safetensors", "mtp_rank_1.safetensors"]
    assert not (folder / "checkpoint" / "mtp.safetensors").exists()
    model = Qwen35Runtime.from_export(folder)
    try:
        assert model.graphs.has_mtp and model.graphs.max_speculative_tokens == 4
        prompts = _rows(fitted, model)
        plain = model.generate(prompts, max_new_tokens=NEW)
        lengths = {}
        for k in (1, 2, 3, 4):
            assert model.generate(prompts, max_new_tokens=NEW, num_speculative_tokens=k) == plain, f"k={k}"
            lengths[k] = model.speculation.acceptance_length
            assert model.speculation.accepted > 0, (k, model.speculation.accepted_per_round)
        print(f"acceptance length per k on the TP 2 export ({manifest['dtype']}): {lengths}")
    finally:
        model.close()
    if dtype == torch.float32:
        single = Qwen35Runtime.from_export(mtp_export(fitted, tmp_path / "tp1", dtype))
        assert single.generate(prompts, max_new_tokens=NEW) == plain
        single.close()


def test_greedy_speculation_on_a_torchneuron_export_equals_greedy_decoding(fitted, tmp_path):
    """The TorchNeuron export (graphs.json entries, no program files): the runner builds the speculative graph modules
    from the entries and torch.compiles them ("eager" on the CPU here)."""
    from optimum_qwen35.backends.torchneuron.runner import load_runtime
    from optimum_qwen35.export.layout import TORCHNEURON_BACKEND
    from tests.kit.mtp_export import mtp_export

    folder = mtp_export(fitted, tmp_path / "export", backend=TORCHNEURON_BACKEND)
    manifest = json.loads((folder / COMPILED_DIR / GRAPHS_FILE).read_text())
    assert {e["kind"] for e in manifest["graphs"].values()} >= {"context_hidden", "verify", "commit", "mtp"}
    assert not any("file" in e for e in manifest["graphs"].values())
    model = load_runtime(folder, compile_backend="eager", device="cpu")
    fitted_prompt = json.loads((fitted / "mtp_fit.json").read_text())["prompts"][0]
    prompts = [fitted_prompt + model.generate([fitted_prompt], max_new_tokens=9)[0], [7, 300, 2] * 5 + [11, 12]]
    plain = model.generate(prompts, max_new_tokens=NEW)
    assert model.generate(prompts, max_new_tokens=NEW, num_speculative_tokens=3) == plain
    assert model.speculation.acceptance_length > 1.3, model.speculation.accepted_per_round
    print(f"acceptance length at k = 3 on the TorchNeuron export: {model.speculation.acceptance_length}")
    model.close()


def test_greedy_speculation_on_a_tensor_parallel_torchneuron_export(fitted, tmp_path):
    """The TorchNeuron export at tensor_parallel_size 2: each worker builds its rank's graph modules from the entries
    (the head sharded as on the CPU) and torch.compiles them ("eager", gloo on the CPU here); k = 3 is plain greedy."""
    from optimum_qwen35.backends.torchneuron.runner import load_runtime
    from optimum_qwen35.export.layout import TORCHNEURON_BACKEND
    from tests.kit.mtp_export import mtp_export

    folder = mtp_export(fitted, tmp_path / "export", backend=TORCHNEURON_BACKEND, tp_degree=2)
    model = load_runtime(folder, compile_backend="eager", device="cpu")
    try:
        prompts = _rows(fitted, model)
        plain = model.generate(prompts, max_new_tokens=NEW)
        assert model.generate(prompts, max_new_tokens=NEW, num_speculative_tokens=3) == plain
        assert model.speculation.acceptance_length > 1.3, model.speculation.accepted_per_round
        print(f"acceptance length at k = 3 on the TP 2 TorchNeuron export: {model.speculation.acceptance_length}")
    finally:
        model.close()
