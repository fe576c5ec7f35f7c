"""paratrain's model behind lm-evaluation-harness's model interface, on the run's own layout.

lm-eval runs the same way on every rank (the same tasks, documents, few-shot examples and requests); this model
shares the requests' forwards over the data-parallel ranks and gathers the answers on every rank, so each rank's
lm-eval computes the same metrics and rank 0 writes them. A batch is the same set of requests on every layout
(sorted by length as lm-eval's own Hugging Face backend sorts them, then cut into `batch_size` requests): batch b
runs on data-parallel rank b % dp, and every rank runs the same number of forwards (the last round padded with a
repeated batch), which FSDP, expert and pipeline parallelism need. tp, pp and cp peers run the same batch: the train
step's `target_scores` gives them the whole sequence's answer (a pipeline runs the batch's stages one after the other,
never its training schedule, so a batch of any size goes through; cp peers attend over whole sequences).

What each request means follows lm-eval's Hugging Face backend (models/huggingface.py), so the numbers compare with
`lm_eval --model hf` on the exported model: a continuation is scored after its context truncated from the left to
`max_length` + 1 tokens; an empty context is the prefix token (BOS, else EOS); rolling log-likelihoods use lm-eval's
windows (`get_rolling_token_windows`, one token of context) with that prefix; generation (batched here, over a KV
cache) runs on its context cut to max_length - max_gen_toks tokens from the left, until a stop sequence, EOS or
max_gen_toks tokens, the text cut at the first stop sequence.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import handle_stop_sequences
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from paratrain.generate import Decoder, cache_exact, choose

MAX_GEN_TOKS = 256  # lm-eval's default for a task that names none


class ParatrainLM(TemplateLM):
    def __init__(self, train_step, tokenizer, max_length: int, batch_size: int, dp: int, dp_rank: int,
                 vocab_size: int, seed: int = 0, use_cache: bool = True):
        """`train_step`: the run's (training/step.py) with the weights to evaluate; `max_length`: the tokens one
        forward sees; `vocab_size`: the model's (generation never picks a padding id past the tokenizer's)."""
        super().__init__()
        self.train_step, self.tokenizer_, self.max_length = train_step, tokenizer, max_length
        self.batch_size, self.dp, self.dp_rank = batch_size, dp, dp_rank
        self.vocab_size, self.seed = vocab_size, seed
        self.use_cache = use_cache  # generation over a KV cache where the layout allows (`cached`)
        self.requests_scored = 0  # forwards' requests on this rank (a throughput figure)
        self.requests_answered = 0  # lm-eval's requests (loglikelihood, rolling, generation) answered

    # -- what lm-eval asks of a model -----------------------------------------------------------------
    @property
    def eot_token_id(self):
        eos = self.tokenizer_.eos_id
        return eos if eos is not None else self.tokenizer_.bos_id

    @property
    def prefix_token_id(self):
        bos = self.tokenizer_.bos_id
        return bos if bos is not None else self.eot_token_id

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        self.requests_answered += len(requests)
        # no progress bar: a run prints one line per evaluation instead (requests, seconds, rate)
        return super().loglikelihood(requests, disable_tqdm=True)

    def tok_encode(self, string: str, **_) -> list[int]:
        return list(self.tokenizer_.encode(string))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **_) -> list[tuple[float, bool]]:
        """[(log P(continuation | context), whether it is the greedy continuation)] of (key, context ids,
        continuation ids) requests."""
        rows = []
        for _, context, continuation in requests:
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            rows.append((whole[:-1], whole[1:], len(continuation)))
        return self._score(rows)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        self.requests_answered += len(requests)
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, predicted in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, predicted))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logp
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        self.requests_answered += len(requests)
        eos_text = self.tokenizer_.decode([self.eot_token_id]) if self.eot_token_id is not None else None
        jobs = []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = dict(gen_kwargs)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text or None)
            max_new = int(kwargs.pop("max_gen_toks", MAX_GEN_TOKS))
            temperature = float(kwargs.get("temperature", 0.0) or 0.0)
            greedy = temperature == 0.0 or kwargs.get("do_sample") is False
            ids = self.tok_encode(context)[-(self.max_length - max_new):] or [self.prefix_token_id]
            jobs.append(Generation(ids, until, max_new, 0.0 if greedy else temperature))
        return self._generate(jobs)

    # -- the forwards, shared over the data-parallel ranks ----------------------------------------------
    def _score(self, rows: list[tuple[list[int], list[int], int]]) -> list[tuple[float, bool]]:
        order = sorted(range(len(rows)), key=lambda i: (-len(rows[i][0]), i))  # longest first, as lm-eval's HF
        batches = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        mine = {}
        rounds = -(-len(batches) // self.dp)
        for r in range(rounds):
            b = r * self.dp + self.dp_rank
            batch = batches[min(b, len(batches) - 1)] if batches else []
            if not batch:
                continue
            length = len(rows[batch[0]][0])  # the batch's longest: padded to it, not to max_length
            tokens = padded([rows[i][0] for i in batch], length)  # (B, T), right-padded
            targets = padded([rows[i][1] for i in batch], length)
            logp, greedy = self.train_step.target_scores(tokens, targets)  # (B, T) each
            if b >= len(batches):
                continue  # a padding round: the same number of forwards on every rank
            self.requests_scored += len(batch)
            for j, i in enumerate(batch):
                n, scored = len(rows[i][0]), rows[i][2]
                mine[i] = (float(logp[j, n - scored:n].sum()), bool(greedy[j, n - scored:n].all()))
        answers = gathered(mine)
        return [answers[i] for i in range(len(rows))]

    def _generate(self, jobs: list["Generation"]) -> list[str]:
        """Batches of `batch_size` requests (longest first) go round the data-parallel ranks, each decoded together
        over a KV cache (generate.Decoder: the prompts left-padded, one forward per new token); every rank runs one
        forward per round until no rank has a batch left, so sharded models stay in step. Without a cache (`use_cache`
        off, context parallelism, experts with a capacity limit: `cached`) and for a request that would pass
        `max_length`, one request at a time."""
        order = sorted(range(len(jobs)), key=lambda i: (-len(jobs[i].ids), i))
        cached = self.cached()
        fits = [i for i in order if cached and len(jobs[i].ids) + jobs[i].max_new <= self.max_length]
        batches = [fits[i:i + self.batch_size] for i in range(0, len(fits), self.batch_size)]
        fitting = set(fits)
        batches += [[i] for i in order if i not in fitting]  # one at a time, longest first
        queue = batches[self.dp_rank::self.dp]
        model = self.train_step.sampler(self.vocab_size)
        mine, batch, decoder, generators = {}, None, None, {}
        was_training = model.training
        model.eval()
        while True:
            if batch is None and queue:
                batch = queue.pop(0)
                decoder = Decoder(model, [jobs[i].ids for i in batch], self.max_length, self.train_step.device,
                                  self.tokenizer_.vocab_size, use_cache=cached,
                                  max_new=max(jobs[i].max_new for i in batch))
                generators = {i: torch.Generator().manual_seed(self.seed + i) for i in batch}
            busy = torch.tensor([0 if batch is None else 1])
            if dist.is_initialized():
                dist.all_reduce(busy, op=dist.ReduceOp.MAX)
            if not busy.item():
                break
            if batch is None:  # this rank's requests are done; the others' forwards need it
                with torch.no_grad():
                    model(torch.tensor([[self.prefix_token_id]], device=self.train_step.device))
                continue
            logits = decoder.logits()  # (B, V)
            greedy = logits.argmax(-1).tolist()  # every row's in one call (choose's at temperature 0)
            tokens = [self.prefix_token_id] * len(batch)  # a finished row's (never read)
            for j, i in enumerate(batch):
                if i in mine:
                    continue
                tokens[j] = greedy[j] if jobs[i].temperature == 0 else \
                    choose(logits[j], jobs[i].temperature, generator=generators[i])
                if jobs[i].step(tokens[j], self.tokenizer_, self.eot_token_id):
                    mine[i] = jobs[i].text
                    self.requests_scored += 1
            if all(i in mine for i in batch):
                batch = None
            else:
                decoder.append(tokens)
        model.train(was_training)
        answers = gathered(mine)
        return [answers[i] for i in range(len(jobs))]

    def cached(self) -> bool:
        """Whether generation decodes over a KV cache on this layout (generate.py: the same tokens as without): not
        under context parallelism, nor for experts with a capacity limit, nor through compiled blocks (a training
        run's: each new length would compile again)."""
        step = self.train_step
        compiled = any(getattr(m, "_compiled_call_impl", None) is not None for m in step.model.modules())
        return self.use_cache and step.context is None and cache_exact(step.moe_layers) and not compiled


class Generation:
    """One generate_until request: its context ids, stop sequences, token budget and temperature (0: greedy)."""

    def __init__(self, ids: list[int], until: list[str], max_new: int, temperature: float):
        self.ids, self.until, self.max_new, self.temperature = ids, until, max_new, temperature
        self.generated: list[int] = []
        self.text = ""

    def step(self, token: int, tokenizer, eos: int | None) -> bool:
        """Take the next token; True when the request is done (its text then cut at the first stop sequence)."""
        finished = token == eos
        if not finished:
            self.generated.append(token)
        self.text = tokenizer.decode(self.generated)
        stops = [s for s in self.until if s]
        finished = finished or len(self.generated) >= self.max_new or any(s in self.text for s in stops)
        if finished:
            for s in stops:
                self.text = self.text.split(s)[0]
        return finished


def padded(rows: list[list[int]], length: int) -> torch.Tensor:
    """(B, length) int64 of id lists right-padded with 0, made in one call (not a tensor per row)."""
    return torch.tensor([row + [0] * (length - len(row)) for row in rows], dtype=torch.long)


def gathered(mine: dict) -> dict:
    """Every rank's answers, by request index, on every rank (peers of a replica hold the same ones)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}
