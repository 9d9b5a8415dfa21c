"""Does generator.close() free a closed generator's locals on this Python? (CPython 3.12.3 did
not for a generator suspended at a yield outside any try block: gh-118272, fixed in 3.12.4.)
Prints one line per case; exit status 0 always: a probe, not a test."""

from __future__ import annotations

import gc
import inspect
import itertools
import sys


class Item:
    pass


def flat(it):
    src = iter(it)
    while True:
        try:
            b = next(src)
        except StopIteration:
            break
        yield b


def guarded(it):
    src = iter(it)
    try:
        while True:
            try:
                b = next(src)
            except StopIteration:
                break
            yield b
    finally:
        src = None


def case(label: str, fn) -> None:
    items = [Item() for _ in range(4)]
    gen = fn(iter(items))
    list(itertools.islice(gen, 1))
    gen.close()
    kept = [type(o).__name__ for o in gc.get_referents(gen) if not isinstance(o, (str, type(case.__code__)))]
    print(f"gen_close_probe: {sys.version.split()[0]} {label:28s} state {inspect.getgeneratorstate(gen)}, "
          f"referents after close: {kept or 'none'} -> {'KEEPS LOCALS' if 'list_iterator' in kept else 'frees locals'}")


case("flat yield", flat)
case("yield inside try/finally", guarded)
try:
    import torch  # noqa: F401

    case("flat yield, torch imported", flat)
except ImportError:
    pass
