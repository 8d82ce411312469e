"""Speculative decoding with the checkpoint's own multi-token-prediction head (`Qwen35Runtime.generate(...,
num_speculative_tokens=k)`): the host loop of one wave, over a graph runner that has the head (runtime/eager.py).

Per row, `last` is the newest emitted token, at position p, not yet run by the main model; the main model's state
holds positions < p, the head's KV cache positions < p. One round:

1. draft: the head's output at position p - 1 (from the previous round) gives d1; k - 1 single steps of the head at
   positions p .. p + k - 2 give d2 .. dk (the head reads its own output and the previous draft);
2. verify: one main-model graph over [last, d1 .. dk] at positions p .. p + k (fewer at the end of the cache):
   logits and final-normed hidden states at each position, the DeltaNet states after each position;
3. accept: greedy, the longest prefix of drafts equal to the main model's argmax, then the main model's own token
   after it; sampled, the standard rejection rule (Leviathan et al. 2023, Chen et al. 2023): draft d (drawn from the
   head's distribution q) is kept with probability min(1, p(d) / q(d)); at the first rejection the token is drawn
   from normalise(max(p - q, 0)); when all k are kept, one more from p. Either way the tokens are distributed as
   plain decoding's (greedy: equal to them);
4. commit: each row's DeltaNet states become those after its accepted position (different per row); attention K/V
   was written at every verified position: those past the accepted one are stale, and never read, since every later
   graph call writes a position before any query at or after it reads it (queries read positions <= their own);
5. catch up: the head runs over positions p .. p + j with the main model's hidden states there and the tokens after
   them (the accepted drafts and the new token), replacing what the drafts wrote; its last output drafts the next
   round's d1.

With a draft vocabulary (runtime/draft_vocab.py: the head scores V_d token ids only), the head's logits are widened
to the whole vocabulary with -inf outside those ids (`_widen`) before a draft is picked: a greedy draft is the argmax
over the subset, a sampled one is drawn from q, which is 0 outside it. The rule above needs nothing more: it holds for
any q that the draft was drawn from (the residual max(p - q, 0) is p itself outside the subset, so the tokens the
head cannot propose are reached through the residual, with the right probability); verification reads the full
vocabulary, so the tokens are still plain decoding's.

A row stops at EOS (inside the accepted tokens too: what follows it is dropped) or at its own max_new_tokens. With
min_new_tokens, EOS is masked out of every logits row that picks a new token before that many (drafts and verified
positions alike, as plain decoding masks its steps), so greedy speculation still returns plain greedy's tokens.
The streamer and the `stop` hook (transformers' stopping criteria) see the steps plain decoding would show them: step
m (every row's first m new tokens) is replayed once no running row has fewer; a row `stop` flags there is cut back to
m tokens and finishes (its cache ran ahead, unused since the row is done).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from optimum_qwen35.errors import IncompatibleExportError, UsageError
from optimum_qwen35.runtime.min_new_tokens import suppress_eos


@dataclass
class SpeculationStats:
    """What the last speculative generate did: verify rounds, drafts proposed and accepted, tokens emitted by the
    rounds (the first token of each prompt comes from prefill and is not counted)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    accepted_per_round: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per verify round (accepted drafts + the verified token): 1.0 when no draft is ever kept."""
        return self.emitted / self.rounds if self.rounds else 0.0


def check_runner(graphs, k: int | None = None) -> None:
    """Whether `graphs` can run speculative decoding with k drafts per round: the MTP head (the eager runtime loaded
    with mtp=True, or an export made with mtp=True) and, for an export, k within the K + 1 positions it verifies."""
    if not getattr(graphs, "has_mtp", False):
        raise IncompatibleExportError(
            "speculative decoding needs the multi-token-prediction head: load the checkpoint with "
            "Qwen35Runtime.from_pretrained(path, ..., mtp=True), or export the model with mtp=True (optimum-qwen35 export --mtp)"
        )
    most = getattr(graphs, "max_speculative_tokens", None)  # (None: the eager runtime takes any k)
    if k is not None and most is not None and k > most:
        raise UsageError(f"num_speculative_tokens={k}, but this export verifies at most {most} drafts per round: pass k <= {most}")


def _sample(probs: torch.Tensor, generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def reject(p: torch.Tensor, q: torch.Tensor, draft: int, generator) -> int | None:
    """The rejection rule for one draft drawn from q: None when it is kept (with probability min(1, p(d) / q(d))),
    else the replacement token, drawn from normalise(max(p - q, 0)). p, q: float64 probabilities [vocab]."""
    if float(torch.rand((), generator=generator, dtype=torch.float64)) * q[draft] < p[draft]:
        return None
    residual = (p - q).clamp(min=0)
    return _sample(residual / residual.sum(), generator)


class _Picker:
    """Greedy (distribution None) or sampled tokens from logits [vocab]; `index` is the new token's index in its row
    (0: the first generated token): below `min_new_tokens` EOS cannot be picked (runtime/min_new_tokens.py)."""

    def __init__(self, distribution, generator, eos, min_new_tokens):
        self.distribution, self.generator = distribution, generator
        self.eos, self.min_new_tokens = eos, min_new_tokens

    def _masked(self, logits: torch.Tensor, index: int) -> torch.Tensor:
        return suppress_eos(logits, self.eos, index, self.min_new_tokens)

    def probs(self, logits: torch.Tensor, index: int) -> torch.Tensor:
        p = self.distribution(self._masked(logits, index)[None].float())[0].double()
        return p / p.sum()

    def pick(self, logits: torch.Tensor, index: int) -> tuple[int, torch.Tensor | None]:
        if self.distribution is None:
            return int(self._masked(logits, index).argmax()), None
        q = self.probs(logits, index)
        return _sample(q, self.generator), q


def _widen(logits: torch.Tensor, runtime) -> torch.Tensor:
    """The head's logits [..., V_d] over the runner's draft vocabulary (`runtime.graphs.draft_ids`) as logits [..., vocab]
    that are -inf outside it (the picker's softmax gives those tokens probability 0); unchanged without one."""
    ids = getattr(runtime.graphs, "draft_ids", None)
    if ids is None:
        return logits
    full = logits.new_full((*logits.shape[:-1], runtime.config.vocab_size), float("-inf"))
    return full.index_copy_(-1, ids, logits)


def _mtp_prefill(runtime, prompts, hiddens, first_tokens, slots):
    """The head over every prompt position (position i reads the prompt's hidden state i and token i + 1; the last
    position the first generated token), in the context buckets. Returns (logits [n, vocab], out [B, H]) at each
    prompt's last position, out padded to the batch's B rows (the head's draft steps take B rows: a wave of fewer
    prompts than B has rows no prompt uses)."""
    graphs, B, largest = runtime.graphs, runtime.batch_size, runtime.buckets[-1]
    n = len(prompts)
    tokens = [list(p[1:]) + [t] for p, t in zip(prompts, first_tokens)]
    hidden_size = hiddens[0].shape[-1]
    done = [0] * n
    last_logits, last_out = [None] * n, [None] * n
    while any(d < len(p) for d, p in zip(done, prompts)):
        rows = [i for i in range(n) if done[i] < len(prompts[i])]
        chunks = {i: range(done[i], min(done[i] + largest, len(prompts[i]))) for i in rows}
        T = runtime.bucket_for(max(len(c) for c in chunks.values()))
        ids = torch.zeros(B, T, dtype=torch.int32)
        hidden = torch.zeros(B, T, hidden_size, dtype=hiddens[0].dtype)
        positions = torch.zeros(B, T, dtype=torch.int32)
        lengths = torch.zeros(B, dtype=torch.int32)
        seq_ids = torch.full((B,), -1, dtype=torch.int32)
        for i, c in chunks.items():
            ids[i, : len(c)] = torch.as_tensor(tokens[i][c.start : c.stop], dtype=torch.int32)
            hidden[i, : len(c)] = hiddens[i][c.start : c.stop]
            positions[i, : len(c)] = torch.arange(c.start, c.stop, dtype=torch.int32)
            lengths[i], seq_ids[i] = len(c), slots[i]
        end = max(c.stop for c in chunks.values())
        key_length = max(T, runtime.key_bucket_for(end)) if any(c.start for c in chunks.values()) else T
        logits, out = graphs.mtp(key_length, ids, hidden, positions, lengths, seq_ids)
        for i, c in chunks.items():
            last_logits[i], last_out[i] = logits[i], out[i]
            done[i] = c.stop
    out = torch.zeros(B, hidden_size, dtype=last_out[0].dtype)
    out[:n] = torch.stack(last_out)
    return _widen(torch.stack(last_logits), runtime), out


class _StepReplay:
    """Calls the streamer and `stop` once per step of plain decoding, though rows advance by several tokens a round:
    step m is shown when every running row has m new tokens (a finished row shows all of its own), with the logits
    each row's m-th token was chosen from (zeros for a row finished before it)."""

    def __init__(self, first_row, outputs, done, streamer, stop):
        self.first_row, self.outputs, self.done = first_row, outputs, done
        self.streamer, self.stop = streamer, stop
        self.steps = 0  # steps shown so far
        self.logits = [{} for _ in outputs]  # row -> {token index: logits}, kept until its step is shown

    def record(self, row: int, index: int, logits: torch.Tensor):
        if self.stop is not None:
            self.logits[row][index] = logits

    def show(self):
        outputs, done = self.outputs, self.done
        while True:
            running = [len(o) for o, d in zip(outputs, done) if not d]
            reach = min(running) if running else max(len(o) for o in outputs)
            if self.steps >= reach:
                return
            m = self.steps = self.steps + 1
            if self.streamer is not None and len(outputs[0]) >= m:
                self.streamer(m - 1, [outputs[0][m - 1]])
            if self.stop is None:
                continue
            rows = [row.pop(m - 1, None) for row in self.logits]
            vocab = next(r.shape[-1] for r in rows if r is not None)
            logits = torch.stack([torch.zeros(vocab) if r is None else r.float() for r in rows])
            flags = self.stop(self.first_row, [o[:m] for o in outputs], logits)
            for i, flag in enumerate(flags):
                if flag and len(outputs[i]) >= m:
                    del outputs[i][m:]
                    done[i] = True
                    self.logits[i].clear()


def generate_wave(runtime, prompts, slots, limits, eos, k, distribution=None, generator=None,
                  stats: SpeculationStats | None = None, min_new_tokens: int = 0, streamer=None, stop=None,
                  first_row: int = 0) -> list[list[int]]:
    """Speculative decoding of one wave (at most batch_size prompts, in `slots`; the first of them is prompt
    `first_row` of the call), k drafts per round, at most `limits[i]` new tokens in row i. `streamer(index, [token])`
    (one-row waves only) and `stop(first_row, new_tokens, logits) -> one bool per row` are called once per step, as
    plain decoding calls them (`_StepReplay`)."""
    graphs, B, max_length = runtime.graphs, runtime.batch_size, runtime.max_length
    n = len(prompts)
    picker = _Picker(distribution, generator, eos, min_new_tokens)
    stats = stats if stats is not None else SpeculationStats()
    logits, hiddens = runtime.prefill(prompts, slots, hidden=True)
    first = [picker.pick(logits[i], 0)[0] for i in range(n)]
    outputs = [[t] for t in first]
    done = [t in eos or limits[i] == 1 for i, t in enumerate(first)]
    replay = _StepReplay(first_row, outputs, done, streamer, stop)
    for i in range(n):
        replay.record(i, 0, logits[i])
    replay.show()
    last, p = list(first), [len(q) for q in prompts]
    draft_logits, draft_out = _mtp_prefill(runtime, prompts, hiddens, first, slots)
    T = k + 1
    steps = torch.arange(T, dtype=torch.int32)
    while not all(done):
        active = [i for i in range(n) if not done[i]]
        seq_ids = torch.full((B,), -1, dtype=torch.int32)
        for i in active:
            seq_ids[i] = slots[i]
        top = min(max_length, max(p[i] for i in active) + T)
        key_length = runtime.key_bucket_for(top)
        # 1. drafts
        drafts = [[0] * k for _ in range(n)]
        q = [[None] * k for _ in range(n)]
        for i in active:
            drafts[i][0], q[i][0] = picker.pick(draft_logits[i], len(outputs[i]))
        out = draft_out
        for s in range(1, k):
            ids = torch.zeros(B, 1, dtype=torch.int32)
            positions = torch.zeros(B, 1, dtype=torch.int32)
            for i in active:
                ids[i, 0], positions[i, 0] = drafts[i][s - 1], p[i] + s - 1
            step_logits, out = graphs.mtp(key_length, ids, out[:, None], positions, torch.ones(B, dtype=torch.int32),
                                          seq_ids)
            step_logits = _widen(step_logits, runtime)
            for i in active:
                drafts[i][s], q[i][s] = picker.pick(step_logits[i], len(outputs[i]) + s)
        # 2. verify
        ids = torch.zeros(B, T, dtype=torch.int32)
        positions = torch.zeros(B, T, dtype=torch.int32)
        lengths = torch.ones(B, dtype=torch.int32)
        for i in active:
            ids[i] = torch.as_tensor([last[i], *drafts[i]], dtype=torch.int32)
            positions[i] = p[i] + steps
            lengths[i] = min(T, max_length - p[i])
        verify_logits, verify_hidden = graphs.verify(key_length, ids, positions, lengths, seq_ids)
        # 3. accept
        accepted = torch.zeros(B, dtype=torch.int64)
        catch_up = torch.zeros(B, T, dtype=torch.int32)
        for i in active:
            room = int(lengths[i]) - 1  # drafts whose verification fits in the cache
            emitted = len(outputs[i])  # verified position j picks new token emitted + j
            j, token = 0, None
            while j < min(k, room):
                target = verify_logits[i, j]
                if distribution is None:
                    if drafts[i][j] != picker.pick(target, emitted + j)[0]:
                        break
                else:
                    token = reject(picker.probs(target, emitted + j), q[i][j], drafts[i][j], generator)
                    if token is not None:
                        break
                j += 1
            if token is None:
                token = picker.pick(verify_logits[i, j], emitted + j)[0]
            accepted[i] = j
            new = drafts[i][:j] + [token]
            stats.rounds += 1
            stats.drafted += min(k, room)
            stats.accepted += j
            stats.emitted += j + 1
            stats.accepted_per_round.append(j)
            for position, t in enumerate(new):
                if len(outputs[i]) == limits[i]:
                    done[i] = True
                    break
                replay.record(i, len(outputs[i]), verify_logits[i, position])
                outputs[i].append(t)
                if t in eos:
                    done[i] = True
                    break
            if len(outputs[i]) == limits[i]:
                done[i] = True
            catch_up[i, : j + 1] = torch.as_tensor(new, dtype=torch.int32)
        replay.show()  # before the head catches up: a row `stop` finishes here drafts no more
        # 4. commit the DeltaNet states after each row's accepted position
        graphs.commit(seq_ids, accepted)
        # 5. the head catches up over the verified positions, with the main model's hidden states
        live = torch.full((B,), -1, dtype=torch.int32)
        for i in active:
            p[i] += int(accepted[i]) + 1
            last[i] = int(catch_up[i, accepted[i]])
            runtime.encoded[slots[i]] = p[i]
            if not done[i]:
                live[i] = slots[i]
        if all(done):
            break
        draft_logits, draft_out = graphs.mtp(
            key_length, catch_up, verify_hidden, positions, (accepted + 1).to(torch.int32), live
        )
        draft_logits = _widen(draft_logits, runtime)
    return outputs
