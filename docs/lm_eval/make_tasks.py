"""Build two small lm-eval tasks from the tiny target's held-out prompts (specs/tiny/eval_prompts.jsonl).

next_line (generate_until): a function's first line(s) and the next line's indentation but one
space -> " " + the rest of that line, exact match. (The byte-level pre-tokenizer splits
"\n    word" as "\n   " + " word", so a context cut there ends on the token the model saw in
training; cut at the newline or after the full indentation it would end on a rare one.)
next_line_choice (multiple_choice): the same context, the true next line among three next
lines of other functions, scored by loglikelihood (echo + logprobs).

    python docs/lm_eval/make_tasks.py   # writes docs/lm_eval/{next_line,next_line_choice}.jsonl
"""

import json
from pathlib import Path

HERE = Path(__file__).parent
PROMPTS = HERE.parent.parent / "specs" / "tiny" / "eval_prompts.jsonl"


def main() -> None:
    rows = []
    for line in PROMPTS.read_text().splitlines():
        lines = json.loads(line)["prompt"].splitlines(keepends=True)
        if len(lines) >= 2 and lines[-1].strip():
            last = lines[-1].rstrip("\n")
            indent = last[: len(last) - len(last.lstrip())]
            if indent:
                rows.append({"context": "".join(lines[:-1]) + indent[:-1], "target": " " + last.lstrip()})
    with open(HERE / "next_line.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    with open(HERE / "next_line_choice.jsonl", "w") as f:
        n = len(rows)
        for i, r in enumerate(rows):
            others = [rows[(i + k * 7) % n]["target"] for k in (1, 2, 3)]  # deterministic distractors
            choices = [r["target"], *others]
            gold = i % 4  # spread the answer over the four slots
            choices[0], choices[gold] = choices[gold], choices[0]
            f.write(json.dumps({"context": r["context"], "choices": choices, "gold": gold}) + "\n")
    print(f"{len(rows)} rows")


if __name__ == "__main__":
    main()
