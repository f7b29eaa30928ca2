"""The client side of ``sb.call``: pickling the call, and decoding an untrusted reply safely."""

from __future__ import annotations

import io
import os
import pickle
import threading
from typing import Any

import cloudpickle
import pytest

from dsec._sdk.calls import SafeUnpickler, _user_module, client_python, decode_reply, encode_call
from dsec.errors import CallFailed, InvalidRequest, RemoteError
from dsec.models import CallResult, ExecResult


def _out(reply: Any, **result: Any) -> CallResult:
    raw = reply if isinstance(reply, bytes) else pickle.dumps(reply)
    return CallResult(reply=raw, result=ExecResult(exit_code=result.pop("exit_code", 0), **result))


class Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned > /tmp/dsec-should-not-exist",))


def test_plain_values_round_trip() -> None:
    value = {"a": [1, 2.5, "s", b"b", None, True], "t": (1, 2), "s": {1}, "f": frozenset({2}), "c": 1 + 2j}
    assert decode_reply(_out(("ok", cloudpickle.dumps(value)))) == value


def test_a_malicious_reply_is_refused_not_executed() -> None:
    for reply in (("ok", pickle.dumps(Evil())), Evil()):
        with pytest.raises(CallFailed):
            decode_reply(_out(reply))
    assert not os.path.exists("/tmp/dsec-should-not-exist")
    with pytest.raises(pickle.UnpicklingError, match=r"posix\.system"):
        SafeUnpickler(io.BytesIO(pickle.dumps(Evil()))).load()


def test_objects_need_trusted() -> None:
    body = cloudpickle.dumps(threading.Event.__name__)  # a str is plain data
    assert decode_reply(_out(("ok", body))) == "Event"
    obj = cloudpickle.dumps(ValueError("x"))
    with pytest.raises(CallFailed, match="trusted=True"):
        decode_reply(_out(("ok", obj)))
    assert isinstance(decode_reply(_out(("ok", obj)), trusted=True), ValueError)


def test_remote_error_carries_type_and_traceback() -> None:
    reply = ("error", {"type": "KeyError", "message": "'k'", "traceback": "Traceback ...\nKeyError: 'k'",
                       "stage": "call"})
    with pytest.raises(RemoteError) as info:
        decode_reply(_out(reply))
    assert info.value.type_name == "KeyError" and info.value.stage == "call"
    assert "Traceback ..." in info.value.remote_traceback and "Remote traceback" in str(info.value)


def test_no_reply_names_the_limit_or_the_crash() -> None:
    with pytest.raises(CallFailed, match="time limit") as info:
        decode_reply(_out(b"", exit_code=137, signal=9, limit="time"))
    assert info.value.detail["limit"] == "time"
    with pytest.raises(CallFailed, match="without a result") as info:
        decode_reply(_out(b"", exit_code=127, stderr=b"python3: not found"))
    assert "python3: not found" in info.value.message
    with pytest.raises(CallFailed, match="malformed"):
        decode_reply(_out(b"\x80\x05garbage"))
    with pytest.raises(CallFailed, match="malformed"):
        decode_reply(_out(("ok", 42)))


def test_encode_rejects_what_cannot_travel() -> None:
    lock = threading.Lock()
    with pytest.raises(InvalidRequest, match="cannot pickle"):
        encode_call(lambda: lock, (), {})
    with pytest.raises(InvalidRequest, match="callable"):
        encode_call(42, (), {})
    func, args, kwargs = cloudpickle.loads(encode_call(max, (1, 2), {"default": 0}))
    assert func is max and args == (1, 2) and kwargs == {"default": 0}
    assert client_python().count(".") == 1


def _local(x: int) -> int:
    return x + 1


def test_callers_own_module_travels_by_value() -> None:
    assert _user_module(_local) is not None  # this test module is not an installed package
    assert _user_module(pickle.dumps) is None and _user_module(cloudpickle.dumps) is None
    payload = encode_call(_local, (1,), {})
    assert b"_make_function" in payload, "pickled by reference: the sandbox could not import this module"
    assert b"_make_function" not in cloudpickle.dumps(_local), "cloudpickle's own default changed"
    func, _, _ = pickle.loads(payload)
    assert func(1) == 2
