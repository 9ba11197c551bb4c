"""Copy-heavy chat prompts, generated from a seed: the tasks where prompt-lookup speculation pays (an
agent repeating a record, editing a function, extracting fields). Three kinds, each answer copying long
spans of its prompt."""

from __future__ import annotations

import random

_FIRST = "Ada Grace Alan Edsger Barbara Donald Margaret Ken Frances John Radia Tim".split()
_LAST = "Lovelace Hopper Turing Dijkstra Liskov Knuth Hamilton Thompson Allen Backus Perlman Berners-Lee".split()
_CITIES = "Paris Lisbon Oslo Kyoto Quito Nairobi Perth Dublin Lima Seoul Tunis Riga".split()
_FIELDS = "invoice_total shipping_cost discount_rate tax_amount unit_price line_count".split()


def _record(rng: random.Random) -> str:
    first, last = rng.choice(_FIRST), rng.choice(_LAST)
    return (f'{{"id": {rng.randrange(10**5)}, "name": "{first} {last}", "email": "{first.lower()}.'
            f'{last.lower()}@example.org", "city": "{rng.choice(_CITIES)}", "balance": {rng.randrange(10**6) / 100}, '
            f'"tags": ["{rng.choice(_CITIES).lower()}", "tier-{rng.randrange(1, 4)}"], "active": true}}')


def _function(rng: random.Random) -> tuple[str, str, str]:
    name, old = rng.choice(_FIELDS), rng.choice(["x", "val", "tmp"])
    body = (f"def compute_{name}(items, {old}):\n"
            f"    \"\"\"Return the {name.replace('_', ' ')} of the order.\"\"\"\n"
            f"    total = 0\n"
            f"    for item in items:\n"
            f"        if item.quantity > 0:\n"
            f"            total += item.price * item.quantity * {old}\n"
            f"    if total > {rng.randrange(100, 999)}:\n"
            f"        total -= total * {old} / 100\n"
            f"    return round(total, 2)\n")
    return body, old, rng.choice(["factor", "rate", "scale"])


def copy_heavy_chats(num: int, seed: int = 0) -> list[list[dict]]:
    """`num` chat conversations, the three kinds in turn."""
    rng = random.Random(seed)
    chats = []
    for i in range(num):
        kind = i % 3
        if kind == 0:
            records = "\n".join(_record(rng) for _ in range(3))
            content = f"Here are three customer records:\n{records}\nRepeat all three records exactly, one per line."
        elif kind == 1:
            body, old, new = _function(rng)
            content = (f"Rename the parameter `{old}` to `{new}` in this function and print the whole "
                       f"function:\n\n{body}")
        else:
            first, last, city = rng.choice(_FIRST), rng.choice(_LAST), rng.choice(_CITIES)
            content = (f"From this message, extract name, email, city and order number as JSON with those keys.\n"
                       f"Message: Hello, this is {first} {last} from {city}. My email is {first.lower()}."
                       f"{last.lower()}@example.org and my order number is ORD-{rng.randrange(10**6):06d}. "
                       f"Please update the delivery address for order ORD-{rng.randrange(10**6):06d} too.")
        chats.append([{"role": "user", "content": content}])
    return chats
