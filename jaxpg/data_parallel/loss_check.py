"""A loss that cannot train, named on the first trace of its step.

A torch habit trains nothing under a functional step: ``loss_fn`` closes over the module as
it was before wrapping (``lambda m, b: loss(model(b[0]), b[1])``) or calls the wrapper
(``ddp(x)``) instead of its model argument ``m``. The module's parameters are then
constants of the step, every gradient is zero and the loss never moves, with no error.

The check reads what the step already traced: the jaxpr of the loss's pullback. If no
gradient depends on the loss's cotangent, the loss depends on no parameter it is
differentiated by, and :class:`LossDoesNotTrainError` names ``loss_fn``, its model argument
and the usual cause. Frozen parameters (``jax.lax.stop_gradient`` on part of the model, an
optimizer that leaves some unchanged) are fine: the check needs only one trainable
dependency. :class:`LossCheck` runs it once per compiled step (on its first trace); later
traces take ``jax.value_and_grad`` directly, so it costs nothing after the first.

:func:`check_depends` is the forward form, for a loss whose model argument is an input of
the loss itself (a pipeline's ``loss_fn(last_params, y, targets)``): it walks the loss's own
jaxpr from the given arguments to the loss.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

__all__ = ["LossCheck", "LossDoesNotTrainError", "check_depends", "describe_loss_fn",
           "jaxpr_depends"]

USUAL_CAUSE = (
    "The usual cause: loss_fn closes over the module as it was before wrapping "
    "(`lambda m, b: loss(model(b[0]), b[1])` with `model` the unwrapped module), or calls "
    "the wrapper inside the loss (`ddp(x)`, `fsdp(x)`). Call the model argument instead: "
    "`lambda m, b: loss(m(b[0]), b[1])`. Frozen parameters are fine, as long as the loss "
    "depends on at least one trainable parameter."
)


class LossDoesNotTrainError(ValueError):
    """``loss_fn`` does not depend on any parameter the step differentiates it by."""


def jaxpr_depends(jaxpr: Any, inputs: Sequence[bool]) -> bool:
    """Whether any output of ``jaxpr`` depends on an input marked in ``inputs``.

    The walk is conservative: an equation whose inputs include a dependent value makes all
    its outputs dependent (sub-jaxprs, ``custom_vjp`` calls and loops are not opened), so a
    False is certain and a True may overstate.

    Args:
        jaxpr: a ``Jaxpr`` (``jax.make_jaxpr(f)(...).jaxpr``).
        inputs: one flag per ``jaxpr.invars``.
    """
    live = {v for v, on in zip(jaxpr.invars, inputs, strict=True) if on}
    if not live:
        return False
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, Literal) and v in live for v in eqn.invars):
            live.update(eqn.outvars)
    return any(not isinstance(v, Literal) and v in live for v in jaxpr.outvars)


def describe_loss_fn(loss_fn: Callable[..., Any]) -> str:
    """``loss_fn``'s name and where it is defined: ``'loss' (train.py:12)``."""
    fn = getattr(loss_fn, "fn", loss_fn)  # a CodeKeyed wrapper
    fn = getattr(fn, "func", fn)  # functools.partial
    fn = getattr(fn, "__func__", fn)  # a bound method
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    if code is None:
        return repr(name)
    return f"{name!r} ({code.co_filename}:{code.co_firstlineno})"


def _argument(loss_fn: Callable[..., Any], index: int) -> str:
    try:
        params = list(inspect.signature(loss_fn).parameters)
    except (TypeError, ValueError):
        return f"argument {index}"
    return f"`{params[index]}`" if index < len(params) else f"argument {index}"


def _cotangent_reaches(vjp_fn: Callable[..., Any], loss: Any) -> bool:
    closed = jax.make_jaxpr(vjp_fn)(jnp.ones_like(loss))
    return jaxpr_depends(closed.jaxpr, [True] * len(closed.jaxpr.invars))


class LossCheck:
    """``jax.value_and_grad`` with the check on the first trace of one compiled step.

    Args:
        loss_fn: the user's loss, named in the error.
        api: the method that runs it (``"DistributedDataParallel.train_step"``).
        model: what ``loss_fn``'s first argument is (``"model"`` for an NNX module,
            ``"parameter"`` for a parameter pytree); its name is read from the signature.
    """

    def __init__(self, loss_fn: Callable[..., Any], *, api: str, model: str = "model"):
        self.loss_fn = loss_fn
        self.api = api
        self.model = model
        self.checked = False

    def value_and_grad(self, f: Callable[..., Any], *args: Any, argnums: int = 0) -> Any:
        """``jax.value_and_grad(f, argnums, has_aux=True)(*args)``, checked once.

        Raises:
            LossDoesNotTrainError: no gradient of ``args[argnums]`` depends on the loss.
        """
        if self.checked:
            return jax.value_and_grad(f, argnums=argnums, has_aux=True)(*args)

        def of(x):
            return f(*args[:argnums], x, *args[argnums + 1:])

        loss, vjp_fn, aux = jax.vjp(of, args[argnums], has_aux=True)
        loss = jnp.asarray(loss)
        if not jnp.issubdtype(loss.dtype, jnp.floating):
            raise TypeError(
                f"{self.api}: loss_fn {describe_loss_fn(self.loss_fn)} must return a "
                f"floating-point loss to differentiate; it returned {loss.dtype}.")
        if not _cotangent_reaches(vjp_fn, loss):
            raise self.error()
        self.checked = True
        (grads,) = vjp_fn(jnp.ones_like(loss))
        return (loss, aux), grads

    def error(self) -> LossDoesNotTrainError:
        """The error naming ``loss_fn``, its model argument and the usual cause."""
        model = f"its {self.model} argument {_argument(self.loss_fn, 0)}"
        return LossDoesNotTrainError(
            f"{self.api}: loss_fn {describe_loss_fn(self.loss_fn)} does not depend on the "
            f"trainable parameters of {model}: every gradient would be zero and no step "
            f"would change the model. {USUAL_CAUSE}")


def check_depends(fn: Callable[..., Any], args: Sequence[Any], on: Sequence[bool], *,
                  loss_fn: Callable[..., Any], api: str, model: str, cause: str) -> Any:
    """Traces ``fn(*args)`` once; raises unless its output depends on the flagged args.

    Args:
        fn: the loss, called as ``fn(*args)``.
        args: its arguments (arrays or ``jax.ShapeDtypeStruct`` trees).
        on: per argument, whether the loss must depend on it (any flagged one suffices).
        loss_fn: the user's loss, named in the error.
        api: the API that runs it.
        model: the flagged arguments, in words (``"last_params or y"``), after "does not
            depend on".
        cause: the usual cause and its fix, for this API's signature.

    Returns:
        The output's shape structure (as ``jax.eval_shape`` gives it).

    Raises:
        LossDoesNotTrainError: the output depends on none of the flagged arguments.
    """
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    flags = [flag for a, flag in zip(args, on, strict=True)
             for _ in jax.tree.leaves(a)]
    if not jaxpr_depends(closed.jaxpr, flags):
        raise LossDoesNotTrainError(
            f"{api}: loss_fn {describe_loss_fn(loss_fn)} does not depend on {model}: no "
            f"gradient would reach the model and no step would change it. {cause}")
    return shape
