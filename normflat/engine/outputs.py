"""What a model returned, reduced to its logits: the same rule in every framework.

Models of the ecosystems return more than an array: a Hugging Face
``ModelOutput`` (a mapping that also has attributes), a dict, a tuple
(``return_dict=False``, Keras models with several outputs). The ``output``
option (method §9) says what to take:

* ``None`` (default): an array as is; else the ``"logits"`` entry of a mapping
  or the ``.logits`` attribute; else the first entry of a tuple or list;
* a string: that key of a mapping, or that attribute;
* an int: that entry of a tuple or list;
* a callable: ``output(model_output) -> logits``.

Anything else is an error naming what the model returned and the fix.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

__all__ = ["select_output", "describe"]


def describe(out: Any) -> str:
    """A short description of a model output for messages (type and keys)."""
    name = type(out).__name__
    if isinstance(out, Mapping):
        return f"{name} with keys {list(map(str, out.keys()))}"
    if isinstance(out, (tuple, list)):
        return f"{name} of length {len(out)}"
    return name


def select_output(out: Any, output: Any, is_array: Callable[[Any], bool]) -> Any:
    """The logits inside a model output ``out``, as the ``output`` option says.

    Args:
        out: What the model's forward returned.
        output: The ``output`` option (``None``, a key/attribute name, an index or a callable).
        is_array: The backend's test for its own array type.

    Raises:
        TypeError: If nothing usable is found; the message lists what the model
            returned and how to choose (``output=``).
    """
    if callable(output) and not isinstance(output, (str, int)):
        picked = output(out)
        if not is_array(picked):
            raise TypeError(
                f"The output= callable returned a {type(picked).__name__}; it must return the logits "
                "array of the model's output."
            )
        return picked
    if output is None:
        if is_array(out):
            return out
        if isinstance(out, Mapping) and "logits" in out:
            picked = out["logits"]
        elif not isinstance(out, Mapping) and is_array(getattr(out, "logits", None)):
            picked = out.logits
        elif isinstance(out, (tuple, list)) and out and is_array(out[0]):
            picked = out[0]
        else:
            raise TypeError(
                f"The model returned a {describe(out)}; normflat needs its logits. Pass output= naming "
                "them: a key or attribute (output='logits'), a tuple index (output=0), or a callable "
                "(output=lambda out: out['scores'])."
            )
    elif isinstance(output, str):
        if isinstance(out, Mapping):
            if output not in out:
                raise TypeError(f"output={output!r}: the model returned a {describe(out)} without that key.")
            picked = out[output]
        elif hasattr(out, output):
            picked = getattr(out, output)
        else:
            raise TypeError(f"output={output!r}: the model returned a {describe(out)} without that attribute.")
    else:  # an int
        if not isinstance(out, (tuple, list)) or not -len(out) <= output < len(out):
            raise TypeError(f"output={output!r}: the model returned a {describe(out)}, which that index does not fit.")
        picked = out[output]
    if not is_array(picked):
        raise TypeError(
            f"The model's output {output!r} is a {type(picked).__name__}, not an array of logits; pass output= "
            "naming the logits."
        )
    return picked
