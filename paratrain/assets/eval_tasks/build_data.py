"""Writes the bundled Shakespeare tasks' documents (shakespeare_*.jsonl) from the last tenth of
paratrain/assets/tinyshakespeare.txt, the part a default run holds out for validation. Deterministic:
`python paratrain/assets/eval_tasks/build_data.py` writes the same files again."""

import json
import random
from pathlib import Path

HERE = Path(__file__).parent
DOCS = 40


def speeches(text: str) -> list[tuple[str, str]]:
    """(speaker, speech) of every speech in `text`, in order."""
    out = []
    for block in text.split("\n\n"):
        name, _, speech = block.partition(":\n")
        if speech and name.strip() and name.upper() == name and "\n" not in name:
            out.append((name.strip(), speech.strip()))
    return out


def main() -> None:
    text = (HERE.parent / "tinyshakespeare.txt").read_text()
    held_out = text[int(len(text) * 0.9):]
    held_out = held_out[held_out.index("\n\n") + 2:]
    rng = random.Random(0)
    found = speeches(held_out)
    lines = [line for _, s in found for line in s.split("\n") if len(line) > 25]
    names = sorted({name for name, _ in found})

    choice, perplexity, speaker = [], [], []
    order = rng.sample(range(1, len(found)), len(found) - 1)
    multiline = [i for i in order if found[i][1].count("\n") >= 1]
    picks = multiline[:2 * DOCS] + [i for i in order if i not in multiline[:2 * DOCS]][:DOCS]
    for i in picks[:DOCS]:  # which line follows the speech's first line
        speech = found[i][1].split("\n")
        wrong = rng.sample([line for line in lines if line != speech[1]], 3)
        answer = rng.randrange(4)
        options = wrong[:answer] + [speech[1]] + wrong[answer:]
        choice.append({"context": f"{found[i][0]}:\n{speech[0]}\n", "choices": options, "label": answer})
    for i in picks[DOCS:2 * DOCS]:  # a whole speech, scored token by token
        perplexity.append({"text": f"{found[i][0]}:\n{found[i][1]}\n"})
    for i in picks[2 * DOCS:]:  # who speaks next (the one who answers, named in the play's own text)
        before, after = found[i - 1], found[i]
        speaker.append({"context": f"{before[0]}:\n{before[1]}\n\n", "speaker": after[0]})
    for name, docs in (("choice", choice), ("perplexity", perplexity), ("speaker", speaker)):
        with open(HERE / f"shakespeare_{name}.jsonl", "w") as f:
            f.writelines(json.dumps(d) + "\n" for d in docs)
    print(f"{len(choice)} choice, {len(perplexity)} perplexity, {len(speaker)} speaker documents ({len(names)} speakers)")


if __name__ == "__main__":
    main()
