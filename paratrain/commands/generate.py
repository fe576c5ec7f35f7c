"""`paratrain generate`: sample from a checkpoint (a step-N folder, a run folder, or a Hugging Face model folder)."""

from __future__ import annotations

import sys

from paratrain.errors import OneLineArgumentParser, UserError

MAX_NEW_TOKENS = 1_000_000


def main(argv: list[str]) -> int:
    parser = OneLineArgumentParser(prog="paratrain generate")
    parser.add_argument("--checkpoint", required=True, help="a step-N checkpoint folder, or a run folder (newest checkpoint)")
    parser.add_argument("--prompt", default="\n")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.max_new_tokens < 0 or args.top_k < 0:
        raise UserError("--max-new-tokens and --top-k must be >= 0")
    if args.max_new_tokens > MAX_NEW_TOKENS:  # every token is kept in memory (and its keys, past the prompt)
        raise UserError(f"--max-new-tokens {args.max_new_tokens} is more than {MAX_NEW_TOKENS} (a typo?)")
    if args.temperature < 0:  # NaN and infinity are refused by the parser
        raise UserError(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
    # lazy: torch is not needed for --help and the argument errors above
    from paratrain.generate import prompt_ids, sample
    from paratrain.inference import load_for_generation

    source = []  # which checkpoint and step (a run folder: its newest intact one)
    model, tokenizer, _, context = load_for_generation(args.checkpoint, notice=source.append)
    ids = prompt_ids(tokenizer, args.prompt)
    print(*source, file=sys.stderr, flush=True)  # once the prompt passed (a bad one: one error line); stdout: the text
    out = sample(model, ids, args.max_new_tokens, context, args.temperature, args.top_k, args.seed,
                 vocab_limit=tokenizer.vocab_size, use_cache=True)
    print(args.prompt + tokenizer.decode(out))
    return 0
