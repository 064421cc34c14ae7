"""Generated English-ish chat text on which clora trains the tiny model's tokenizer.

No data set can be downloaded where clora is built, so the byte-level BPE tokenizer of the tiny local
model (`learner/tiny_model.py`) learns its merges from text made here. The text is made to look like the
traffic the tiny model will see: chat turns (`user` / `assistant` / `system` roles), digits and
arithmetic, UPPER CASE words, one-word and paragraph-long answers, and small JSON objects. The demo's
simulated users reward exactly those traits (digits, upper case, short answers, valid JSON), so the
tokenizer needs tokens for all of them, or a reward like "fraction of digits" has nothing to grip on.

The text is a pure function of `seed` and `target_chars`: the same arguments give the same string on every
machine (one `random.Random`, no hashing of sets, no clock). It deliberately knows nothing of tokenizers
or models; `tiny_model.py` trains on it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator

# The tokenizer is shared by every tiny model, whatever the model's seed, so the corpus has its own.
CORPUS_SEED = 20240607
DEFAULT_TARGET_CHARS = 300_000

# ---------------------------------------------------------------------------------------------------------
# Vocabulary

NAMES = (
    "Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Liam Maria Noah Olivia Paul Quinn Rosa "
    "Sam Tara Uma Victor Wendy Xavier Yara Zoe Amir Bianca Chen Diego Elena Farah Hiro Ines Jonas Kofi Lena"
).split()
CITIES = (
    "Paris London Berlin Madrid Rome Tokyo Lima Cairo Oslo Dublin Vienna Prague Lisbon Seoul Delhi Sydney "
    "Toronto Boston Denver Austin Chicago Nairobi Athens Warsaw Zurich Helsinki"
).split()
NOUNS = (
    "apple river mountain garden window computer teacher student market bridge forest ocean city village "
    "book letter song picture train bicycle kitchen table chair door street road cloud storm island planet "
    "engine robot model server user answer question number word sentence story report meeting project team "
    "company customer order invoice ticket message email account password file folder database network "
    "coffee bread cheese orange lemon dog cat bird horse fish flower tree stone star moon sun morning night "
    "library hospital school office airport station museum theatre restaurant hotel beach desert valley "
    "lake field farm harbour castle tower palace temple church factory shop bakery pharmacy kitchen "
    "keyboard screen phone camera printer battery cable router laptop tablet program function variable "
    "document budget salary price discount payment receipt contract lawyer doctor nurse farmer driver "
    "pilot artist writer singer dancer player coach judge child parent friend neighbour stranger family "
    "holiday weekend journey adventure problem solution reason example result method experiment theory "
    "science history music language country mountain weather season spring summer autumn winter"
).split()
ADJECTIVES = (
    "small large quick slow bright dark happy sad old new young quiet loud simple complex warm cold green "
    "blue red yellow heavy light short long early late clean busy calm strange useful careful friendly "
    "honest modern ancient tiny huge safe fast empty full famous hidden important different possible "
    "beautiful wonderful terrible difficult easy expensive cheap narrow wide deep shallow gentle brave "
    "clever curious polite rude lazy eager nervous proud quiet rapid silent smooth rough sharp soft "
    "sweet bitter fresh frozen golden silver wooden digital ordinary special"
).split()
VERBS = (
    "walk run write read build open close find keep send move help learn teach cook paint carry watch "
    "follow check count fix clean plan start finish visit call answer choose explain describe measure "
    "remember forget borrow return collect deliver repair compare discover imagine improve prepare "
    "protect receive remove replace report share support travel wonder wash order print save load"
).split()
ADVERBS = (
    "quickly slowly carefully quietly happily often rarely always never usually today tomorrow yesterday "
    "soon later again together finally suddenly probably certainly honestly exactly almost"
).split()
CONNECTIVES = (
    "because although when while after before unless since so but and however therefore meanwhile "
    "otherwise instead"
).split()
WEEKDAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
MONTHS = "January February March April May June July August September October November December".split()
NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve twenty thirty forty fifty "
    "hundred thousand million first second third half double"
).split()
COLORS = "red green blue yellow purple orange black white grey pink brown".split()
TOPICS = (
    "the weather, a recipe, the history of trains, learning a language, saving money, a trip to the sea, "
    "the solar system, how bees live, writing a letter, fixing a bicycle, training a dog, planting tomatoes, "
    "sorting numbers, reading maps, the rules of chess, making tea, the moon, a good night of sleep"
).split(", ")
SHORT_ANSWERS = (
    "Yes.",
    "No.",
    "OK.",
    "Sure.",
    "Done.",
    "Maybe.",
    "Thanks!",
    "Of course.",
    "Not today.",
    "I agree.",
    "Good idea.",
    "Right.",
    "Correct.",
    "Wrong.",
    "True.",
    "False.",
    "42.",
    "Hello!",
)
SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in one line.",
    "Answer only with numbers.",
    "Reply in UPPER CASE.",
    "Always answer with a JSON object.",
    "You are a friendly tutor who explains things step by step.",
)

# ---------------------------------------------------------------------------------------------------------
# Pieces


def _plural(noun: str) -> str:
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    if noun.endswith(("s", "sh", "ch", "x")):
        return noun + "es"
    return noun + "s"


def _sentence(rng: random.Random) -> str:
    subject = rng.choice([rng.choice(NAMES), f"the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"])
    verb, noun, adj = rng.choice(VERBS), rng.choice(NOUNS), rng.choice(ADJECTIVES)
    city, count = rng.choice(CITIES), rng.randint(0, 1000)
    text = rng.choice(
        (
            f"{subject} will {verb} the {noun} {rng.choice(ADVERBS)}",
            f"{subject} can {verb} {count} {_plural(noun)} in {city}",
            f"{subject} is {adj} and {rng.choice(ADJECTIVES)}",
            f"{subject} wanted to {verb} a {rng.choice(COLORS)} {noun}",
            f"in {city}, {subject} does not {verb} on {rng.choice(WEEKDAYS)}",
            f"{subject} should {verb} {rng.choice(NUMBER_WORDS)} {_plural(noun)} {rng.choice(CONNECTIVES)} "
            f"the {rng.choice(NOUNS)} is {adj}",
            f"in {rng.choice(MONTHS)}, {subject} would {verb} the {adj} {noun} with a {rng.choice(NOUNS)}",
            f"{subject} could not {verb} the {noun} {rng.choice(CONNECTIVES)} it was {adj}",
            f"there are {count} {_plural(noun)} near the {rng.choice(NOUNS)}",
        )
    )
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "!", "?"])


def _paragraph(rng: random.Random, sentences: int) -> str:
    return " ".join(_sentence(rng) for _ in range(sentences))


def _json_object(rng: random.Random) -> dict:
    fields: dict[str, Callable[[], object]] = {
        "name": lambda: rng.choice(NAMES),
        "age": lambda: rng.randint(1, 99),
        "city": lambda: rng.choice(CITIES),
        "color": lambda: rng.choice(COLORS),
        "count": lambda: rng.randint(0, 500),
        "price": lambda: round(rng.uniform(0.5, 999), 2),
        "active": lambda: rng.choice([True, False]),
        "tags": lambda: rng.sample(NOUNS, rng.randint(0, 3)),
        "score": lambda: round(rng.uniform(-1, 1), 3),
        "id": lambda: rng.randint(1000, 99999),
        "answer": lambda: rng.choice(SHORT_ANSWERS).rstrip(".!"),
        "note": lambda: None,
        "items": lambda: [rng.randint(0, 9) for _ in range(rng.randint(1, 5))],
        "owner": lambda: {"name": rng.choice(NAMES), "id": rng.randint(1, 999)},
    }
    keys = rng.sample(sorted(fields), rng.randint(1, 4))
    return {k: fields[k]() for k in keys}


def _json_text(rng: random.Random, obj: object) -> str:
    if rng.random() < 0.7:
        return json.dumps(obj)
    return json.dumps(obj, indent=2)


# ---------------------------------------------------------------------------------------------------------
# Exchanges: (user prompt, assistant answer)


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    op, value = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
    prompt = rng.choice([f"What is {a} {op} {b}?", f"Compute {a}{op}{b}.", f"Please calculate {a} {op} {b}"])
    answer = rng.choice([str(value), f"{a} {op} {b} = {value}", f"The answer is {value}."])
    return prompt, answer


def _digits(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(3, 12)
    prompt = rng.choice(
        [
            f"Give me {n} random digits.",
            f"List {n} numbers.",
            "Write a phone number.",
            "What year is it?",
            f"Count from 1 to {n}.",
            "What time is it?",
        ]
    )
    if prompt.startswith("Count"):
        answer = ", ".join(str(i) for i in range(1, n + 1))
    elif "phone" in prompt:
        answer = f"+{rng.randint(1, 99)} {rng.randint(100, 999)} {rng.randint(1000, 9999)} {rng.randint(100, 999)}"
    elif "year" in prompt:
        answer = str(rng.randint(1900, 2100))
    elif "time" in prompt:
        answer = f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}"
    elif "digits" in prompt:
        answer = "".join(str(rng.randint(0, 9)) for _ in range(n))
    else:
        answer = " ".join(str(rng.randint(0, 10_000)) for _ in range(n))
    return prompt, answer


def _upper(rng: random.Random) -> tuple[str, str]:
    words = [rng.choice(NOUNS + ADJECTIVES + VERBS) for _ in range(rng.randint(1, 8))]
    prompt = rng.choice(
        [
            f"Write '{' '.join(words)}' in capital letters.",
            "Shout a greeting!",
            "Say something in UPPER CASE.",
            f"Make this loud: {_sentence(rng)}",
        ]
    )
    if prompt.startswith("Make this loud: "):
        answer = prompt.removeprefix("Make this loud: ").upper()
    elif "greeting" in prompt:
        answer = rng.choice(["HELLO THERE!", "HI, FRIEND!", "GOOD MORNING!", "WELCOME BACK!", "HEY YOU!"])
    else:
        answer = " ".join(words).upper()
    return prompt, answer


def _json(rng: random.Random) -> tuple[str, str]:
    obj = _json_object(rng)
    keys = ", ".join(obj)
    prompt = rng.choice(
        [
            f"Return a JSON object with the keys {keys}.",
            "Answer in JSON.",
            f"Give me valid JSON describing a {rng.choice(NOUNS)}.",
            f"Convert this to JSON: {keys}",
        ]
    )
    answer = _json_text(rng, obj)
    if rng.random() < 0.2:
        answer = f"Here is the JSON:\n{answer}"
    return prompt, answer


def _short(rng: random.Random) -> tuple[str, str]:
    prompt = rng.choice(
        [
            f"Is the {rng.choice(NOUNS)} {rng.choice(ADJECTIVES)}?",
            f"Can you {rng.choice(VERBS)} it?",
            "Answer in one word.",
            f"Do you like {rng.choice(COLORS)}?",
            "Ready?",
            f"Which city is bigger, {rng.choice(CITIES)} or {rng.choice(CITIES)}?",
        ]
    )
    answer = rng.choice(SHORT_ANSWERS) if "city" not in prompt else rng.choice(CITIES) + "."
    return prompt, answer


def _long(rng: random.Random) -> tuple[str, str]:
    topic = rng.choice(TOPICS)
    prompt = rng.choice(
        [
            f"Tell me about {topic}.",
            f"Explain {topic} in detail.",
            f"Write a short story about {rng.choice(NAMES)} and {topic}.",
            f"Can you describe {topic}? Please be thorough.",
        ]
    )
    parts = [_paragraph(rng, rng.randint(2, 6)) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.3:
        parts.append("\n".join(f"{i}. {_sentence(rng)}" for i in range(1, rng.randint(3, 6))))
    if rng.random() < 0.2:
        parts.append("\n".join(f"- {_sentence(rng)}" for _ in range(rng.randint(2, 4))))
    return prompt, "\n\n".join(parts)


EXCHANGES: tuple[Callable[[random.Random], tuple[str, str]], ...] = (
    _arithmetic,
    _digits,
    _upper,
    _json,
    _short,
    _long,
)

# ---------------------------------------------------------------------------------------------------------
# The corpus


def conversations(seed: int = CORPUS_SEED) -> Iterator[list[dict[str, str]]]:
    """An endless, seeded stream of chat conversations as `[{"role", "content"}]` lists."""
    rng = random.Random(seed)
    while True:
        messages = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for _ in range(rng.choice([1, 1, 1, 2, 3])):
            prompt, answer = rng.choice(EXCHANGES)(rng)
            messages.append({"role": "user", "content": prompt})
            messages.append({"role": "assistant", "content": answer})
        yield messages


def render(messages: list[dict[str, str]]) -> str:
    """A conversation laid out as ChatML would lay it out, minus the special tokens (added to the
    tokenizer separately), so role names and the newlines around them get merges."""
    return "".join(f"{m['role']}\n{m['content']}\n" for m in messages)


def corpus_texts(seed: int = CORPUS_SEED, target_chars: int = DEFAULT_TARGET_CHARS) -> list[str]:
    """Rendered conversations, in order, until together they hold at least `target_chars` characters."""
    if target_chars < 1:
        raise ValueError(f"target_chars must be positive, got {target_chars}")
    texts, total = [], 0
    for conversation in conversations(seed):
        text = render(conversation)
        texts.append(text)
        total += len(text)
        if total >= target_chars:
            return texts
    raise AssertionError("conversations() is endless")  # pragma: no cover
