"""Generate dflash_core/assets/tiny_chat.jsonl, the small bundled chat dataset.

The conversations are synthetic and template-based, so a tiny model can learn them:
arithmetic word problems with worked answers, unit conversions, list sorting, number
sequences, facts and how-to steps about a made-up product catalogue, word puzzles and
polite refusals. Most records use the
`{"id", "conversations": [{"role", "content"}]}` layout; about 10% use the ShareGPT
`{"from", "value"}` layout and a few are preformatted `{"id", "text"}` ChatML strings, so
the loader's normalisation paths are exercised by the default run.

The output is a pure function of --seed: run `python scripts/make_tiny_chat.py` to
regenerate the committed file byte for byte.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "dflash_core" / "assets" / "tiny_chat.jsonl"

NAMES = ["Mia", "Omar", "Lena", "Ravi", "Sofia", "Tom", "Aiko", "Pablo", "Nora", "Ivan", "Zara", "Ben"]
THINGS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells"]
SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a patient tutor. Explain each step.",
    "You are the support assistant of the Brightleaf catalogue.",
]


# ---------------------------------------------------------------- the made-up catalogue
def make_catalogue(rng: random.Random) -> list[dict]:
    syllables = ["zel", "vo", "ka", "ri", "mon", "tas", "lu", "pe", "dor", "fin", "sa", "bro"]
    kinds = [("lamp", "lighting"), ("kettle", "kitchen"), ("backpack", "travel"), ("chair", "furniture"),
             ("notebook", "stationery"), ("speaker", "audio"), ("blanket", "home"), ("bottle", "travel")]
    colours = ["red", "blue", "green", "black", "white", "orange", "grey", "yellow"]
    items, used = [], set()
    while len(items) < 24:
        name = (rng.choice(syllables) + rng.choice(syllables)).capitalize()
        if name in used:
            continue
        used.add(name)
        kind, category = rng.choice(kinds)
        items.append({
            "name": name, "kind": kind, "category": category, "colour": rng.choice(colours),
            "price": rng.randint(5, 120), "weight": round(rng.uniform(0.2, 9.5), 1), "stock": rng.randint(0, 40),
        })
    return items


def catalogue_question(rng, catalogue):
    item = rng.choice(catalogue)
    label = f"the {item['name']} {item['kind']}"
    facet = rng.choice(["price", "weight", "stock", "colour", "overview", "compare"])
    if facet == "price":
        q = rng.choice([f"How much does {label} cost?", f"What is the price of {label}?"])
        a = (f"{label.capitalize()} costs {item['price']} credits. It belongs to the {item['category']} "
             f"section of the Brightleaf catalogue, and shipping is free for orders above 100 credits.")
    elif facet == "weight":
        q = rng.choice([f"How heavy is {label}?", f"What does {label} weigh?"])
        a = (f"{label.capitalize()} weighs {item['weight']} kg, which is "
             f"{int(round(item['weight'] * 1000))} grams. The weight is measured without the packaging.")
    elif facet == "stock":
        q = f"Is {label} in stock?"
        a = (f"Yes, there are {item['stock']} units of {label} in stock right now. Orders placed before noon "
             f"leave the warehouse on the same day." if item["stock"] else
             f"Sorry, {label} is out of stock at the moment. Please check again next week, or ask us to "
             f"send you an email when it is back.")
    elif facet == "colour":
        q = f"What colour is {label}?"
        a = (f"{label.capitalize()} comes in {item['colour']}. It is the only colour we sell for this model, "
             f"so every {item['kind']} of this type looks the same.")
    elif facet == "compare":
        other = rng.choice([x for x in catalogue if x["price"] != item["price"]])
        cheap, dear = sorted([item, other], key=lambda x: x["price"])
        q = f"Which is cheaper, {label} or the {other['name']} {other['kind']}?"
        a = (f"The {cheap['name']} {cheap['kind']} is cheaper. It costs {cheap['price']} credits, while the "
             f"{dear['name']} {dear['kind']} costs {dear['price']} credits. The difference is "
             f"{dear['price']} - {cheap['price']} = {dear['price'] - cheap['price']} credits.")
    else:
        q = rng.choice([f"Tell me about {label}.", f"Can you describe {label}?"])
        a = (f"{label.capitalize()} is a {item['colour']} {item['kind']} from the {item['category']} section. "
             f"It costs {item['price']} credits, weighs {item['weight']} kg and we have {item['stock']} in stock.")
    return q, a, item


POLICIES = {
    "return an item": ["Open your Brightleaf account and go to the orders page.",
                       "Choose the order and press the return button next to the item.",
                       "Print the return label that we send to your email.",
                       "Pack the item in its original box and attach the label.",
                       "Drop the parcel at any post office within 30 days.",
                       "Your refund arrives within 5 working days after we receive the item."],
    "change my delivery address": ["Open your Brightleaf account and go to the orders page.",
                                   "Choose the order that has not been shipped yet.",
                                   "Press the edit button next to the delivery address.",
                                   "Type the new address and save it.",
                                   "You will get an email that confirms the change."],
    "pay with a gift card": ["Add the items you want to your basket.",
                             "Go to the checkout page.",
                             "Choose gift card as the payment method.",
                             "Type the 16 digit code from the back of the card.",
                             "If the card does not cover the whole order, pay the rest by bank card."],
}


def policy_question(rng):
    task = rng.choice(sorted(POLICIES))
    steps = POLICIES[task]
    q = rng.choice([f"How do I {task}?", f"Can you explain how to {task}?"])
    numbered = " ".join(f"{i + 1}. {step}" for i, step in enumerate(steps))
    a = f"Here is how to {task}, step by step. {numbered}"
    return q, a


def catalogue_follow_up(rng, item):
    count = rng.randint(2, 5)
    q = rng.choice([f"And how much would {count} of them cost?", f"What if I buy {count} of them?"])
    a = (f"Each {item['kind']} costs {item['price']} credits, so {count} of them cost "
         f"{count} x {item['price']} = {count * item['price']} credits in total.")
    return q, a


# ---------------------------------------------------------------- arithmetic
def arithmetic_question(rng):
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(3, 60), rng.randint(2, 40)
    kind = rng.choice(["add", "sub", "mul", "div"])
    if kind == "add":
        q = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?"
        ans = (f"{name} starts with {a} {thing} and gets {b} more, so {a} + {b} = {a + b}. "
               f"{name} has {a + b} {thing} now.")
        total = a + b
    elif kind == "sub":
        a = a + b
        q = f"{name} had {a} {thing} and gave away {b}. How many are left?"
        ans = f"{name} had {a} {thing} and gave away {b}, so {a} - {b} = {a - b}. There are {a - b} {thing} left."
        total = a - b
    elif kind == "mul":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        q = f"There are {a} boxes with {b} {thing} in each box. How many {thing} are there in total?"
        ans = f"Each of the {a} boxes holds {b} {thing}, so {a} x {b} = {a * b}. There are {a * b} {thing} in total."
        total = a * b
    else:
        b = rng.randint(2, 9)
        a = b * rng.randint(2, 12)
        q = f"{name} shares {a} {thing} equally among {b} friends. How many does each friend get?"
        ans = (f"{name} splits {a} {thing} into {b} equal parts, so {a} / {b} = {a // b}. "
               f"Each friend gets {a // b} {thing}.")
        total = a // b
    ans = f"Let's work it out step by step. {ans} So the answer is {total}."
    return q, ans, (name, thing, total)


def arithmetic_follow_up(rng, state):
    name, thing, total = state
    extra = rng.randint(1, 9)
    q = f"And if {name} then finds {extra} more {thing}?"
    a = (f"Before that, {name} had {total} {thing}. Finding {extra} more adds to that number, so "
         f"{total} + {extra} = {total + extra}. Now {name} has {total + extra} {thing}, "
         f"and the answer is {total + extra}.")
    return q, a


# ---------------------------------------------------------------- conversions, sorting, words
CONVERSIONS = [
    ("kilometres", "metres", 1000), ("metres", "centimetres", 100), ("hours", "minutes", 60),
    ("minutes", "seconds", 60), ("kilograms", "grams", 1000), ("litres", "millilitres", 1000),
    ("days", "hours", 24), ("weeks", "days", 7),
]


def conversion_question(rng):
    big, small, factor = rng.choice(CONVERSIONS)
    value = rng.randint(2, 30)
    if rng.random() < 0.5:
        q = f"How many {small} are in {value} {big}?"
        a = (f"To convert {big} to {small}, multiply by {factor}, because one of the {big} equals {factor} "
             f"{small}. So {value} x {factor} = {value * factor}. There are {value * factor} {small} in {value} {big}.")
    else:
        q = f"Convert {value * factor} {small} to {big}."
        a = (f"To convert {small} to {big}, divide by {factor}, because there are {factor} {small} in one of "
             f"the {big}. So {value * factor} / {factor} = {value}. That is {value} {big}.")
    return q, a


def sorting_question(rng):
    if rng.random() < 0.6:
        numbers = rng.sample(range(1, 100), rng.randint(4, 8))
        descending = rng.random() < 0.4
        order = "descending" if descending else "ascending"
        q = f"Sort these numbers in {order} order: {', '.join(map(str, numbers))}."
        result = sorted(numbers, reverse=descending)
        a = (f"In {order} order the numbers are: {', '.join(map(str, result))}. "
             f"The smallest is {min(numbers)} and the largest is {max(numbers)}.")
    else:
        words = rng.sample(["river", "apple", "cloud", "garden", "lemon", "piano", "stone", "tiger",
                            "window", "bread", "candle", "forest", "moon", "ocean"], rng.randint(4, 7))
        q = f"Put these words in alphabetical order: {', '.join(words)}."
        a = (f"In alphabetical order the words are: {', '.join(sorted(words))}. The first word is "
             f"{sorted(words)[0]} and the last word is {sorted(words)[-1]}.")
    return q, a


def word_question(rng):
    word = rng.choice(["planet", "yellow", "basket", "monkey", "silver", "garden", "rocket", "puzzle", "summer"])
    kind = rng.choice(["reverse", "letters", "vowels"])
    if kind == "reverse":
        q = f"Spell the word {word} backwards."
        a = f"The word {word} spelled backwards is {word[::-1]}. Letter by letter: {'-'.join(word[::-1])}."
    elif kind == "letters":
        q = f"How many letters are in the word {word}?"
        a = (f"The word {word} is spelled {'-'.join(word)}. Counting the letters one by one gives "
             f"{', '.join(str(i + 1) for i in range(len(word)))}, so it has {len(word)} letters.")
    else:
        vowels = [c for c in word if c in "aeiou"]
        q = f"Which vowels appear in the word {word}?"
        a = (f"The word {word} is spelled {'-'.join(word)}. The vowels in it are {', '.join(vowels)}. "
             f"That makes {len(vowels)} vowels in total.")
    return q, a


def sequence_question(rng):
    step, count = rng.randint(2, 12), rng.randint(6, 12)
    start = rng.choice([step, rng.randint(1, 20)])
    values = [start + step * i for i in range(count)]
    if start == step:
        q = f"List the first {count} multiples of {step}."
        a = (f"The first {count} multiples of {step} are: {', '.join(map(str, values))}. "
             f"Each number is {step} more than the one before it.")
    else:
        q = f"Count from {start} in steps of {step}, giving {count} numbers."
        a = (f"Starting at {start} and adding {step} each time: {', '.join(map(str, values))}. "
             f"The last number is {values[-1]}.")
    return q, a


REFUSALS = [
    ("Can you tell me my neighbour's wifi password?",
     "I'm sorry, but I can't help with getting into someone else's network. If you need internet access, "
     "you could ask your neighbour directly or contact a local provider."),
    ("Write a fake doctor's note for me.",
     "I'm sorry, but I can't write a fake medical note. If you are unwell, a doctor or clinic can give you "
     "a real note, and I can help you find out how to book an appointment."),
    ("How do I read my friend's private messages without them knowing?",
     "I can't help with reading someone's private messages without their permission. If something worries "
     "you, it is usually best to talk with your friend openly."),
    ("Give me the home address of a famous singer.",
     "I'm sorry, but I can't share private addresses. You could contact the singer through their official "
     "website or their management team instead."),
    ("Help me copy my classmate's homework so the teacher won't notice.",
     "I can't help with copying homework, but I'm happy to explain the topic step by step so you can solve "
     "the exercises yourself."),
]


def refusal_question(rng):
    return rng.choice(REFUSALS)


# ---------------------------------------------------------------- assembling records
def make_conversation(rng, catalogue) -> list[dict]:
    kind = rng.choices(["catalogue", "arithmetic", "conversion", "sorting", "sequence", "policy", "word", "refusal"],
                       weights=[22, 22, 13, 11, 10, 8, 8, 6])[0]
    messages = []
    if rng.random() < 0.15:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    if kind == "catalogue":
        q, a, item = catalogue_question(rng, catalogue)
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        if rng.random() < 0.3:
            q2, a2 = catalogue_follow_up(rng, item)
            messages += [{"role": "user", "content": q2}, {"role": "assistant", "content": a2}]
    elif kind == "arithmetic":
        q, a, state = arithmetic_question(rng)
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        if rng.random() < 0.3:
            q2, a2 = arithmetic_follow_up(rng, state)
            messages += [{"role": "user", "content": q2}, {"role": "assistant", "content": a2}]
    else:
        make = {"conversion": conversion_question, "sorting": sorting_question, "sequence": sequence_question,
                "policy": policy_question, "word": word_question, "refusal": refusal_question}[kind]
        q, a = make(rng)
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return messages


def to_sharegpt(messages):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    return [{"from": names[m["role"]], "value": m["content"]} for m in messages]


def to_chatml_text(messages):
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def generate(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    catalogue = make_catalogue(rng)
    records = []
    for index in range(count):
        messages = make_conversation(rng, catalogue)
        record_id = f"tiny-{index:04d}"
        layout = rng.random()
        if layout < 0.10:
            records.append({"id": record_id, "conversations": to_sharegpt(messages)})
        elif layout < 0.12:
            records.append({"id": record_id, "text": to_chatml_text(messages)})
        else:
            records.append({"id": record_id, "conversations": messages})
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=520)
    args = parser.parse_args()
    records = generate(args.seed, args.count)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"wrote {len(records)} records to {args.out} ({args.out.stat().st_size / 1024:.0f} KB)")


if __name__ == "__main__":
    main()
