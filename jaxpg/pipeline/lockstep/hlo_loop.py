"""What a compiled pipeline step runs inside its loop, read from the optimized HLO text.

The executor runs the schedule's ticks as one ``while`` loop (a ``lax.scan``). The
benchmark counts the matmuls a tick runs and the tests check what the loop copies; both
read the text of ``jax.jit(f).lower(...).compile().as_text()``:

* :func:`computations` splits the text into its computations (name -> body lines);
* :func:`loop_computations` / :func:`loop_text`: the while bodies and all they call,
  each computation once;
* :func:`count_in_loop` counts a substring per call site, so a computation called
  twice counts twice (every branch of a conditional once).

Example:
    >>> import jax, jax.numpy as jnp
    >>> def f(x, w):
    ...     return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w) @ w, None), x, None, 3)[0]
    >>> x = w = jnp.ones((4, 4))
    >>> hlo = jax.jit(f).lower(x, w).compile().as_text()
    >>> count_in_loop(hlo, " dot(")
    2
"""

from __future__ import annotations

import functools
import re

_HEAD = re.compile(r"^(?:ENTRY )?(%[\w.\-]+) ")
_CALLED = re.compile(r"(?:body|calls|to_apply|branch_computations)=\{?([%\w.\-, ]+)\}?")
_LOOP_BODY = re.compile(r"body=(%[\w.\-]+)")


def computations(hlo: str) -> dict[str, list[str]]:
    """Splits HLO text into its computations.

    Args:
        hlo: the text of a compiled (or lowered) HLO module.

    Returns:
        Each computation's name (with its ``%``) -> the lines of its body (the closing
        brace included), in the order of the text.
    """
    bodies: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        head = _HEAD.match(line)
        if head and line.rstrip().endswith("{"):
            name = head.group(1)
            bodies[name] = []
        elif name is not None:
            bodies[name].append(line)
    return bodies


def _called(line: str) -> list[str]:
    """The computations one instruction calls (loop body, fusion, reducer, branches)."""
    return [c.strip() for group in _CALLED.findall(line) for c in group.split(",")]


def loop_bodies(bodies: dict[str, list[str]]) -> list[str]:
    """The names of the while loops' bodies, once per ``while`` that names one."""
    return [b for text in bodies.values() for line in text for b in _LOOP_BODY.findall(line)]


def loop_computations(hlo: str) -> dict[str, list[str]]:
    """The while loops' bodies and every computation they call, each once.

    Args:
        hlo: the text of a compiled HLO module.

    Returns:
        Name -> body lines of each computation reached from a while body (an empty dict
        where the module has no while loop).
    """
    bodies = computations(hlo)
    todo = loop_bodies(bodies)
    seen: dict[str, list[str]] = {}
    while todo:
        comp = todo.pop()
        if comp in seen or comp not in bodies:
            continue
        seen[comp] = bodies[comp]
        for line in bodies[comp]:
            todo += _called(line)
    return seen


def loop_text(hlo: str) -> str:
    """The lines of every computation the while loops run (:func:`loop_computations`)."""
    return "\n".join(line for lines in loop_computations(hlo).values() for line in lines)


def count_in_loop(hlo: str, needle: str) -> int:
    """How often ``needle`` occurs in what the while loops run, counted per call site.

    Every while body counts with all it calls, recursively: a computation called from
    two places counts twice, and every branch of a conditional counts once (so for a
    pipeline tick with one stage per rank, ``" dot("`` gives the matmuls of one
    microbatch's F, B and W). A loop nested in a loop counts once as its own loop and
    once more through the outer body.

    Args:
        hlo: the text of a compiled HLO module.
        needle: the substring to count, e.g. ``" dot("``.

    Returns:
        The count; 0 where the module has no while loop.
    """
    bodies = computations(hlo)

    @functools.cache
    def count(comp: str) -> int:
        return sum(
            line.count(needle) + sum(count(c) for c in _called(line))
            for line in bodies.get(comp, ())
        )

    return sum(count(b) for b in set(loop_bodies(bodies)))
