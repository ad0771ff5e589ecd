"""Write data/demo_agentic.jsonl: reasoning and tool-use conversations written for this project.

Deterministic (fixed seed); every figure in an answer is computed here, so the data is correct.
The mix follows what an agentic reasoning model like Kimi-K2.5 is mostly asked to do: about
half the conversations call tools (single, parallel and chained calls, tool results, follow-up
questions), the rest are multi-turn reasoning chats; some later turns answer without reasoning
(instant mode). Contents are plain strings (tool-call-only turns have content ""), so the file
renders under any chat template, ChatML included.

    python data/make_demo_agentic.py      # rewrites data/demo_agentic.jsonl
"""

from __future__ import annotations

import json
import math
import random
from datetime import date
from pathlib import Path

OUT = Path(__file__).resolve().parent / "demo_agentic.jsonl"
SEED = 20261201
N_TOOL, N_REASONING = 100, 80

TOOLS = {
    "get_weather": {"description": "Current weather for a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string",
                                                                              "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}},
    "calculator": {"description": "Evaluate an arithmetic expression.", "parameters": {
        "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}},
    "convert_currency": {"description": "Convert an amount between currencies at today's rate.", "parameters": {
        "type": "object", "properties": {"amount": {"type": "number"}, "from": {"type": "string"},
                                         "to": {"type": "string"}}, "required": ["amount", "from", "to"]}},
    "search_web": {"description": "Search the web and return the top result's snippet.", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}},
    "get_time": {"description": "Current local time in an IANA time zone.", "parameters": {
        "type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}},
}

CITIES = {  # city: (temperature C, condition, humidity %)
    "Paris": (14, "light rain", 82), "Tokyo": (21, "clear", 55), "Berlin": (9, "overcast", 74),
    "Cairo": (29, "sunny", 31), "Toronto": (3, "snow showers", 88), "Sydney": (24, "partly cloudy", 60),
    "Mumbai": (32, "humid and hazy", 79), "Madrid": (18, "sunny", 40), "Oslo": (-2, "clear", 65),
    "Lima": (19, "fog", 86), "Nairobi": (22, "scattered clouds", 58), "Seoul": (12, "windy", 45),
}
RATES_TO_USD = {"USD": 1.0, "EUR": 1.08, "GBP": 1.27, "JPY": 0.0067, "CHF": 1.13, "CAD": 0.73, "INR": 0.012}
ZONES = {"Europe/Paris": "14:05", "Asia/Tokyo": "22:05", "America/New_York": "08:05", "Australia/Sydney": "00:05",
         "Asia/Kolkata": "18:35"}
FACTS = {  # query: (snippet, fact for the answer, number or None)
    "height of Mount Everest": ("Mount Everest is 8,849 metres (29,032 ft) above sea level, per the 2020 survey.",
                                "8,849 m", 8849),
    "speed of light in vacuum": ("The speed of light in vacuum is exactly 299,792,458 metres per second.",
                                 "299,792,458 m/s", 299792458),
    "boiling point of water at sea level": ("At standard sea-level pressure, water boils at 100 °C (212 °F).",
                                            "100 °C", 100),
    "length of the Great Wall of China": ("A 2012 survey measured all branches of the Great Wall at 21,196 km.",
                                          "21,196 km", 21196),
    "year the Eiffel Tower opened": ("The Eiffel Tower opened to the public in 1889 for the World's Fair.",
                                     "1889", 1889),
    "distance from Earth to the Moon": ("The average Earth-Moon distance is about 384,400 km.", "384,400 km", 384400),
}
SYSTEMS = ["You are a helpful assistant with access to tools. Use them when they help.",
           "You are an agent. Call tools for live data; answer briefly.",
           None, None]


class Ids:
    """Tool-call ids in Kimi's form `functions.NAME:INDEX`, numbered per conversation."""

    def __init__(self) -> None:
        self.n = 0

    def call(self, name: str, arguments: dict, as_object: bool = False) -> dict:
        call_id = f"functions.{name}:{self.n}"
        self.n += 1
        args = arguments if as_object else json.dumps(arguments, ensure_ascii=False)
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def tool_decls(names: list[str]) -> list[dict]:
    return [{"type": "function", "function": {"name": n, **TOOLS[n]}} for n in names]


def result(call: dict, payload: dict | str) -> dict:
    content = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return {"role": "tool", "tool_call_id": call["id"], "content": content}


def assistant(content: str, reasoning: str | None = None, calls: list[dict] | None = None) -> dict:
    m = {"role": "assistant", "content": content}
    if reasoning:
        m["reasoning_content"] = reasoning
    if calls:
        m["tool_calls"] = calls
    return m


def fmt(x: float) -> str:
    return f"{x:,.2f}".rstrip("0").rstrip(".")


# --- tool-use conversations -------------------------------------------------------------------

def weather(rng: random.Random, ids: Ids) -> tuple[list[dict], list[str]]:
    city = rng.choice(sorted(CITIES))
    t, cond, hum = CITIES[city]
    f = t * 9 / 5 + 32
    call = ids.call("get_weather", {"city": city, "unit": "celsius"}, as_object=rng.random() < 0.3)
    ask = rng.choice([f"What's the weather like in {city} right now?", f"Do I need a jacket in {city} today?",
                      f"Weather check for {city}, please."])
    msgs = [{"role": "user", "content": ask},
            assistant("", f"The user wants the current weather in {city}. I'll call get_weather.", [call]),
            result(call, {"city": city, "temperature_c": t, "condition": cond, "humidity": hum}),
            assistant(f"In {city} it is {t} °C ({fmt(f)} °F) with {cond} and {hum}% humidity."
                      + (" Take a warm jacket." if t < 12 else " A light layer is enough." if t < 22 else
                         " No jacket needed."),
                      f"{t} °C is {t} × 9/5 + 32 = {fmt(f)} °F. {cond}, humidity {hum}%. "
                      f"{'Cold' if t < 12 else 'Mild' if t < 22 else 'Warm'}, so advise accordingly.")]
    if rng.random() < 0.4:
        msgs += [{"role": "user", "content": "Thanks! And in Fahrenheit only?"},
                 assistant(f"{fmt(f)} °F.")]  # instant mode: no reasoning
    return msgs, ["get_weather"]


def compare_weather(rng: random.Random, ids: Ids) -> tuple[list[dict], list[str]]:
    a, b = rng.sample(sorted(CITIES), 2)
    calls = [ids.call("get_weather", {"city": c}) for c in (a, b)]
    (ta, ca, _), (tb, cb, _) = CITIES[a], CITIES[b]
    warmer, diff = (a, ta - tb) if ta >= tb else (b, tb - ta)
    return [{"role": "user", "content": f"Which is warmer right now, {a} or {b}?"},
            assistant("", "I need both cities' weather; the two calls are independent, so I'll make them together.",
                      calls),
            result(calls[0], {"city": a, "temperature_c": ta, "condition": ca}),
            result(calls[1], {"city": b, "temperature_c": tb, "condition": cb}),
            assistant(f"{warmer} is warmer: {a} is at {ta} °C ({ca}) and {b} at {tb} °C ({cb}), "
                      f"a difference of {diff} °C." if diff else f"They are the same: {ta} °C in both.",
                      f"{a}: {ta} °C, {b}: {tb} °C. Difference |{ta} - {tb}| = {diff}.")], ["get_weather"]


def currency(rng: random.Random, ids: Ids) -> tuple[list[dict], list[str]]:
    src, dst = rng.sample(sorted(RATES_TO_USD), 2)
    amount = rng.choice([20, 75, 120, 250, 999, 1500, 40000])
    value = amount * RATES_TO_USD[src] / RATES_TO_USD[dst]
    rate = RATES_TO_USD[src] / RATES_TO_USD[dst]
    call = ids.call("convert_currency", {"amount": amount, "from": src, "to": dst}, as_object=rng.random() < 0.3)
    return [{"role": "user", "content": f"How much is {amount:,} {src} in {dst}?"},
            assistant("", f"Currency conversion at today's rate: call convert_currency with {amount} {src} -> {dst}.",
                      [call]),
            result(call, {"amount": amount, "from": src, "to": dst, "rate": round(rate, 6),
                          "result": round(value, 2)}),
            assistant(f"{amount:,} {src} is about **{fmt(value)} {dst}** at today's rate "
                      f"(1 {src} = {rate:.4g} {dst}).",
                      f"The tool returned {round(value, 2)} at rate {rate:.4g}. Report it rounded to cents.")
            ], ["convert_currency", "calculator"]


def interest(rng: random.Random, ids: Ids) -> tuple[list[dict], list[str]]:
    principal, rate, years = rng.choice([1000, 2500, 5000, 12000]), rng.choice([3, 4, 5, 7]), rng.choice([2, 5, 10])
    expr = f"{principal} * (1 + {rate}/100) ** {years}"
    value = principal * (1 + rate / 100) ** years
    call = ids.call("calculator", {"expression": expr})
    return [{"role": "user", "content": f"If I invest ${principal:,} at {rate}% a year compounded annually, "
                                        f"what do I have after {years} years?"},
            assistant("", f"Compound interest: P(1 + r)^n with P = {principal}, r = {rate}%, n = {years}. "
                          "Use the calculator for the power.", [call]),
            result(call, {"expression": expr, "result": round(value, 6)}),
            assistant(f"After {years} years you would have **${fmt(value)}**, "
                      f"of which ${fmt(value - principal)} is interest.",
                      f"{expr} = {round(value, 6)}. Interest = {fmt(value)} - {principal} = {fmt(value - principal)}.")
            ], ["calculator"]


def search_then_compute(rng: random.Random, ids: Ids) -> tuple[list[dict], list[str]]:
    query = rng.choice(sorted(FACTS))
    snippet, fact, number = FACTS[query]
    search = ids.call("search_web", {"query": query})
    msgs = [{"role": "user", "content": f"Quick question: what is the {query}?"},
            assistant("", f"This is a factual lookup; search for '{query}'.", [search]),
            result(search, snippet),
            assistant(f"The {query} is {fact}. Source snippet: \"{snippet}\"",
                      f"The snippet says {fact}. Answer with it and quote the source.")]
    if rng.random() < 0.6:
        factor = rng.choice([2, 3, 10])
        calc = ids.call("calculator", {"expression": f"{number} * {factor}"})
        msgs += [{"role": "user", "content": f"And {factor} times that?"},
                 assistant("", f"Multiply {number} by {factor}; use the calculator to be exact.", [calc]),
                 result(calc, {"expression": f"{number} * {factor}", "result": number * factor}),
                 assistant(f"{factor} × {fact} = {number * factor:,}.", f"{number} × {factor} = {number * factor}.")]
    return msgs, ["search_web", "calculator"]


def world_time(rng: random.Random, ids: Ids) -> tuple[list[dict], list[str]]:
    zone = rng.choice(sorted(ZONES))
    city = zone.split("/")[1].replace("_", " ")
    call = ids.call("get_time", {"timezone": zone})
    hour = int(ZONES[zone][:2])
    ok = 9 <= hour < 18
    return [{"role": "user", "content": f"Is it a good time to call someone in {city}?"},
            assistant("", f"{city} is in the {zone} time zone; get its local time first.", [call]),
            result(call, {"timezone": zone, "local_time": ZONES[zone]}),
            assistant(f"It is {ZONES[zone]} in {city}, " + ("within normal working hours, so yes." if ok else
                                                         "outside normal working hours; better wait."),
                      f"Local time {ZONES[zone]}: hour {hour}, working hours are 9-18, so "
                      f"{'fine' if ok else 'not a good time'}.")], ["get_time", "get_weather"]


TOOL_SCENARIOS = [weather, compare_weather, currency, interest, search_then_compute, world_time]


def tool_conversation(rng: random.Random, i: int) -> dict:
    ids = Ids()
    messages, tools = rng.choice(TOOL_SCENARIOS)(rng, ids)
    system = rng.choice(SYSTEMS)
    if system:
        messages = [{"role": "system", "content": system}, *messages]
    return {"id": f"agentic-tool-{i:04d}", "tools": tool_decls(tools), "messages": messages}


# --- reasoning conversations ------------------------------------------------------------------

def percent(rng: random.Random) -> list[dict]:
    p, n = rng.choice([5, 12, 15, 20, 35, 60, 85]), rng.choice([40, 80, 250, 360, 1200, 4500])
    v, q = p * n / 100, rng.choice([10, 25, 50])
    return [{"role": "user", "content": f"What is {p}% of {n}?"},
            assistant(f"{p}% of {n} is **{fmt(v)}**.", f"{p}% = {p}/100. {p}/100 × {n} = {p * n}/100 = {fmt(v)}."),
            {"role": "user", "content": f"And {q}%?"},
            assistant(f"{q}% of {n} is **{fmt(q * n / 100)}**.", f"{q}/100 × {n} = {fmt(q * n / 100)}.")]


def travel(rng: random.Random) -> list[dict]:
    d, v = rng.choice([120, 150, 300, 420, 540]), rng.choice([60, 75, 80, 90, 100])
    h = d / v
    hours, minutes = int(h), round((h - int(h)) * 60)
    return [{"role": "user", "content": f"A train covers {d} km at {v} km/h. How long does the trip take?"},
            assistant(f"The trip takes {hours} h {minutes:02d} min ({fmt(h)} hours).",
                      f"time = distance / speed = {d} / {v} = {fmt(h)} h. The fraction {fmt(h - int(h))} h "
                      f"× 60 = {minutes} min.")]


def series(rng: random.Random) -> list[dict]:
    n = rng.choice([10, 20, 50, 100, 250])
    s = n * (n + 1) // 2
    return [{"role": "user", "content": f"What's the sum of all integers from 1 to {n}?"},
            assistant(f"The sum is **{s:,}**.",
                      f"Gauss: pair 1 with {n}, 2 with {n - 1}, ...; each pair sums to {n + 1} and there are "
                      f"{n}/2 pairs. {n} × {n + 1} / 2 = {s}."),
            {"role": "user", "content": "Nice trick. Does it work for odd n too?"},
            assistant("Yes. n(n + 1)/2 is always a whole number because one of n and n + 1 is even; "
                      "for odd n the middle number simply pairs with itself.",
                      "For odd n the pairing leaves the middle term (n+1)/2 alone, but the formula still holds: "
                      "n(n+1) is even.")]


def primes(rng: random.Random) -> list[dict]:
    n = rng.choice([91, 97, 119, 127, 143, 151, 221, 229, 323, 331])
    factors = [p for p in range(2, int(math.isqrt(n)) + 1) if n % p == 0]
    if factors:
        p = factors[0]
        answer, why = f"No: {n} = {p} × {n // p}.", f"Try primes up to √{n} ≈ {math.isqrt(n)}: {n} / {p} = {n // p}."
    else:
        answer = f"Yes, {n} is prime."
        why = (f"√{n} ≈ {math.sqrt(n):.1f}; none of the primes up to {math.isqrt(n)} divides {n}, "
               "so it is prime.")
    return [{"role": "user", "content": f"Is {n} a prime number?"}, assistant(answer, why)]


def gcd_lcm(rng: random.Random) -> list[dict]:
    a, b = rng.sample([12, 18, 24, 30, 42, 56, 84, 90, 105], 2)
    g = math.gcd(a, b)
    return [{"role": "user", "content": f"Find the GCD and LCM of {a} and {b}."},
            assistant(f"GCD({a}, {b}) = {g}, LCM({a}, {b}) = {a * b // g}.",
                      f"Euclid: gcd({a}, {b}) = {g}. lcm = {a} × {b} / {g} = {a * b // g}.")]


def dates(rng: random.Random) -> list[dict]:
    y = rng.choice([2024, 2025, 2026])
    a = date(y, rng.randint(1, 6), rng.randint(1, 28))
    b = date(y, rng.randint(7, 12), rng.randint(1, 28))
    days = (b - a).days
    return [{"role": "user", "content": f"How many days are there from {a:%B} {a.day}, {y} to {b:%B} {b.day}, {y}?"},
            assistant(f"There are **{days} days** between the two dates (weeks: {days // 7} and {days % 7} days).",
                      f"Count the days left in {a:%B}, the full months in between and the days of {b:%B}"
                      f"{' (leap year: February has 29)' if y % 4 == 0 else ''}: {days} in total.")]


def fractions(rng: random.Random) -> list[dict]:
    (a, b), (c, d) = rng.sample([(2, 3), (3, 4), (5, 8), (7, 10), (4, 7), (5, 9)], 2)
    left, right = a * d, c * b
    bigger = f"{a}/{b}" if left > right else f"{c}/{d}"
    return [{"role": "user", "content": f"Which is larger, {a}/{b} or {c}/{d}?"},
            assistant(f"**{bigger}** is larger.",
                      f"Cross-multiply: {a} × {d} = {left} and {c} × {b} = {right}; {max(left, right)} is bigger.")]


def rectangle(rng: random.Random) -> list[dict]:
    w, h = rng.choice([3, 4, 6, 8, 12]), rng.choice([5, 7, 9, 15])
    return [{"role": "user", "content": f"A rectangle is {w} m by {h} m. What are its area and perimeter?"},
            assistant(f"Area: {w * h} m². Perimeter: {2 * (w + h)} m.",
                      f"Area = {w} × {h} = {w * h}. Perimeter = 2 × ({w} + {h}) = {2 * (w + h)}."),
            {"role": "user", "content": "And the diagonal?"},
            assistant(f"The diagonal is √({w}² + {h}²) = √{w * w + h * h} ≈ {math.hypot(w, h):.2f} m.",
                      f"Pythagoras: {w * w} + {h * h} = {w * w + h * h}, square root ≈ {math.hypot(w, h):.2f}.")]


REASONING_SCENARIOS = [percent, travel, series, primes, gcd_lcm, dates, fractions, rectangle]


def reasoning_conversation(rng: random.Random, i: int) -> dict:
    messages = rng.choice(REASONING_SCENARIOS)(rng)
    if rng.random() < 0.3:
        messages = [{"role": "system", "content": "Think step by step, then answer concisely."}, *messages]
    return {"id": f"agentic-reasoning-{i:04d}", "messages": messages}


def main() -> None:
    rng = random.Random(SEED)
    records = [tool_conversation(rng, i) for i in range(N_TOOL)]
    records += [reasoning_conversation(rng, i) for i in range(N_REASONING)]
    rng.shuffle(records)
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    print(f"wrote {len(records)} conversations to {OUT}")


if __name__ == "__main__":
    main()
