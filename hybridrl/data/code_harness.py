"""The code_tests harness: the program `code_tests` runs in the sandbox for assert and check tests.
Never imported by the trainer: its text is the sandboxed program (`/tmp/prog.py`), standard library only.

Two processes, so that the verdict is out of the solution's reach:

  checker  - starts the solution's process first, then makes itself undumpable (no /proc/PID/mem or
             /proc/PID/fd for the solution) and only then reads the tests and the report's nonce from
             its stdin. It runs the setup and the tests in its own interpreter, where each name the
             solution defined is bound to its value (plain data) or to a `Remote` handle: calling one
             sends the arguments, as plain data, to the solution's process and gets the result back
             as plain data (JSON with tags for tuples, sets, dicts, bytes, ...). Comparisons (`==` in
             an assert, check()'s asserts) run here, on values that crossed as data: an object whose
             `__eq__` is always true never crosses (a handle compares by identity, and is counted).
             It writes the report (behind the nonce) on the sandbox's stdout, which the solution's
             process does not hold.
  solution - forked before the checker read anything: its memory never held the tests, the expected
             values or the nonce. Runs the setup and the solution in one namespace (as MBPP's and
             HumanEval's harnesses do), then serves calls on two pipes; its stdout and stderr go to a
             third, which the checker drains and drops (a solution may print as much as it likes).

What a solution does to its own interpreter (patching builtins or json, reading its frames, walking
the garbage collector's objects) changes nothing the checker computes. It is counted (`hostile` in
the report) where it shows: builtins or the harness's modules replaced, gc.get_objects and kin
called, a decoy nonce kept in the solution's frames printed, a handle compared, a reply that is not
the protocol's.
"""

import ast
import builtins
import collections
import ctypes
import decimal
import fractions
import importlib
import json
import os
import select
import signal
import struct
import sys
import time
import types

MAX_LINE = 64 << 20  # the longest reply the checker reads
MAX_ITEMS = 1 << 20  # items a handle's iteration may yield
INTROSPECTION = {"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames"}
PLAIN = (type(None), bool, int, float, str)
DICTS = {"dict": dict, "Counter": collections.Counter, "OrderedDict": collections.OrderedDict}
_NT: dict = {}


class Gone(BaseException):
    """The solution's process is gone or past the deadline: no test that needs it passes."""


# --- plain data, both ways ----------------------------------------------------------------------------
def encode(v, other):
    """`v` as JSON-able plain data; a value of any other type as `other(v)` (a handle or a refusal)."""
    t = type(v)
    if any(t is p for p in PLAIN):  # exact types, by identity: a subclass or a metaclass's __eq__ never passes
        return v
    if t is list:
        return [encode(x, other) for x in v]
    if t is tuple:
        return {"t": [encode(x, other) for x in v]}
    if t is set or t is frozenset:
        return {"s" if t is set else "fs": [encode(x, other) for x in v]}
    if t in (dict, collections.Counter, collections.OrderedDict, collections.defaultdict):
        kind = "dict" if t in (dict, collections.defaultdict) else t.__name__
        return {"d": [kind, [[encode(k, other), encode(x, other)] for k, x in dict.items(v)]]}
    if t is bytes or t is bytearray:
        return {"b" if t is bytes else "ba": v.hex()}
    if t is complex:
        return {"c": [v.real, v.imag]}
    if t is range:
        return {"r": [v.start, v.stop, v.step]}
    if t is fractions.Fraction:
        return {"fr": [v.numerator, v.denominator]}
    if t is decimal.Decimal:
        return {"dec": str(v)}
    if issubclass(t, tuple) and type(getattr(t, "_fields", None)) is tuple:  # a namedtuple
        fields = [f for f in t._fields if type(f) is str]
        return {"nt": [str(t.__name__), fields, [encode(x, other) for x in tuple.__iter__(v)]]}
    return other(v)


def decode(x, other):
    """The value `x` (from encode) stands for; a tag that is not plain data as `other(tag, value)`."""
    if type(x) in PLAIN:
        return x
    if type(x) is list:
        return [decode(i, other) for i in x]
    if type(x) is not dict or len(x) != 1:
        raise ValueError("not plain data")
    ((tag, val),) = x.items()
    if tag == "t":
        return tuple(decode(i, other) for i in val)
    if tag == "s" or tag == "fs":
        return (set if tag == "s" else frozenset)(decode(i, other) for i in val)
    if tag == "d":
        kind, pairs = val
        return DICTS[kind]({decode(k, other): decode(v, other) for k, v in pairs})
    if tag == "b" or tag == "ba":
        return (bytes if tag == "b" else bytearray).fromhex(val)
    if tag == "r":
        return range(int(val[0]), int(val[1]), int(val[2]))
    if tag == "c":
        return complex(float(val[0]), float(val[1]))
    if tag == "fr":
        return fractions.Fraction(int(val[0]), int(val[1]))
    if tag == "dec":
        return decimal.Decimal(str(val))
    if tag == "nt":
        name, fields, items = val
        key = (str(name), tuple(map(str, fields)))
        if key not in _NT:
            _NT[key] = collections.namedtuple(*key)
        return _NT[key](*(decode(i, other) for i in items))
    return other(tag, val)


def _line(fd: int, pending: bytearray, deadline: float, drain=None) -> bytes:
    """One line from `fd`, reading `drain` (an object with `.output`, an fd or None, and `.drained`)
    meanwhile. Raises Gone at the deadline or at the end of `fd`."""
    while b"\n" not in pending:
        watch = [fd] + ([drain.output] if drain is not None and drain.output is not None else [])
        left = deadline - time.monotonic()
        if left <= 0:
            raise Gone("deadline")
        ready = select.select(watch, [], [], min(left, 3600.0))[0]
        for r in sorted(ready, key=lambda r: r == fd):  # the output first: what it printed, then its end
            chunk = os.read(r, 1 << 16)
            if r != fd:
                drain.drained(chunk)
                continue
            if not chunk:
                raise Gone("the solution's process ended")
            pending += chunk
            if len(pending) > MAX_LINE:
                raise Gone("a reply too long")
    i = pending.index(b"\n")
    line = bytes(pending[:i])
    del pending[: i + 1]
    return line


def _send(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view[: 1 << 16]) :]


# --- the solution's process -----------------------------------------------------------------------
def solution_side(calls: int, replies: int, decoy: str) -> None:
    nonce = decoy  # noqa: F841  a bait: what a solution digging the report's nonce out of its frames finds
    flags = set()
    pristine = _fingerprint()

    def audit(event, args):
        if event in INTROSPECTION:
            flags.add("introspection")

    sys.addaudithook(audit)
    out = bytearray()

    def reply(msg: dict) -> None:
        if _fingerprint() != pristine:
            flags.add("tampered")
        msg["flags"] = sorted(flags)
        _send(replies, (json.dumps(msg) + "\n").encode())

    ns = {"__name__": "__main__", "__builtins__": builtins}
    refs: dict = {}

    def handle(v):
        refs[id(v)] = v
        return {"ref": id(v)}

    def resolve(tag, val):
        if tag == "ref":
            return refs[val]
        if tag == "g":
            return ns[val]
        raise ValueError(tag)

    try:
        with open("/tmp/setup.py", encoding="utf-8") as f:
            exec(compile(f.read(), "setup", "exec"), ns)
        before = dict(ns)
        with open("/tmp/solution.py", encoding="utf-8") as f:
            exec(compile(f.read(), "solution.py", "exec"), ns)
    except BaseException as e:  # noqa: BLE001  SystemExit included: no test then passes
        reply({"failed": f"{type(e).__name__}: {e}"})
        return
    names = {}
    for k, v in list(ns.items()):
        if k.startswith("__") or k in before and before[k] is v:
            continue
        names[k] = {"mod": v.__name__} if isinstance(v, types.ModuleType) else encode(v, handle)
    reply({"names": names})
    while True:
        try:
            req = json.loads(_line(calls, out, float("inf")))
        except Gone:
            return
        try:
            target = refs[req["ref"]]
            args = [decode(a, resolve) for a in req["args"]]
            kwargs = {k: decode(a, resolve) for k, a in req["kwargs"].items()}
            op = req["op"]
            if op == "call":
                got = target(*args, **kwargs)
            elif op == "getattr":
                got = getattr(target, args[0])
            elif op == "getitem":
                got = target[args[0]]
            elif op == "iter":
                got = []
                for x in target:
                    got.append(x)
                    if len(got) > MAX_ITEMS:
                        raise OverflowError("an iteration too long")
            else:
                got = {"len": len, "bool": bool, "str": str, "repr": repr}[op](target)
            mutable = [encode(a, handle) if type(a) in (list, dict, set, bytearray) else None for a in args]
            reply({"ok": encode(got, handle), "args": mutable})
        except BaseException as e:  # noqa: BLE001
            reply({"raise": type(e).__name__, "msg": str(e)[:1000]})


def _fingerprint() -> list:
    """What a solution patches to fake a verdict inside its own process: builtins, json."""
    return [(k, id(v)) for m in (builtins, json, json.encoder, json.decoder) for k, v in sorted(vars(m).items())]


# --- the checker ----------------------------------------------------------------------------------
class Remote:
    """A value in the solution's process. Calls, attributes, items, iteration, len, bool, str and repr
    are asked of it and answered as plain data; it equals only itself (never asked: counted)."""

    __slots__ = ("_id", "_peer")

    def __init__(self, rid, peer):
        object.__setattr__(self, "_id", rid)
        object.__setattr__(self, "_peer", peer)

    def __call__(self, *args, **kwargs):
        return self._peer.ask("call", self._id, args, kwargs)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._peer.ask("getattr", self._id, (name,))

    def __getitem__(self, key):
        return self._peer.ask("getitem", self._id, (key,))

    def __iter__(self):
        return iter(self._peer.ask("iter", self._id, (), want=list))

    def __contains__(self, x):
        return x in list(self)  # compared here: `x` never crosses

    def __len__(self):
        return self._peer.ask("len", self._id, (), want=int)

    def __bool__(self):
        return self._peer.ask("bool", self._id, (), want=bool)

    def __str__(self):
        return self._peer.ask("str", self._id, (), want=str)

    def __repr__(self):
        return self._peer.ask("repr", self._id, (), want=str)

    def __eq__(self, other):
        self._peer.flags.add("compared")
        return self is other

    def __ne__(self, other):
        self._peer.flags.add("compared")
        return self is not other

    __hash__ = object.__hash__


class Peer:
    def __init__(self, pid, calls, replies, output, deadline, setup_ns):
        self.pid, self.calls, self.replies, self.output = pid, calls, replies, output
        self.deadline, self.ns, self.pending, self.tail = deadline, setup_ns, bytearray(), b""
        self.flags, self.decoy, self.gone, self.sent = set(), None, False, []
        self.globals = {id(v): k for k, v in setup_ns.items() if not k.startswith("__")}

    def drained(self, chunk: bytes) -> None:
        if not chunk:
            os.close(self.output)
            self.output = None
            return
        seen = self.tail + chunk
        if self.decoy and self.decoy.encode() in seen:
            self.flags.add("decoy")
        self.tail = seen[-64:]

    def read(self) -> dict:
        if self.gone:
            raise Gone("gone")
        try:
            msg = json.loads(_line(self.replies, self.pending, self.deadline, self))
            if type(msg) is not dict:
                raise ValueError("not a message")
        except Gone:
            self.stop()
            self.drain_rest()
            raise
        except ValueError:
            self.flags.add("protocol")
            self.stop()
            raise Gone("protocol") from None
        got = msg.get("flags", [])
        self.flags.update(f for f in got if f in ("tampered", "introspection")) if type(got) is list else None
        return msg

    def drain_rest(self) -> None:
        """What the solution printed before it went (a decoy nonce, say), for a moment at most."""
        until = min(self.deadline, time.monotonic() + 0.5)
        while self.output is not None and time.monotonic() < until:
            if select.select([self.output], [], [], max(until - time.monotonic(), 0))[0]:
                self.drained(os.read(self.output, 1 << 16))

    def stop(self) -> None:
        if not self.gone:
            self.gone = True
            try:
                os.kill(self.pid, signal.SIGKILL)
            except OSError:
                pass

    def send(self, text: str) -> None:
        try:
            _send(self.calls, text.encode())
        except OSError:
            self.stop()
            raise Gone("gone") from None

    def prefetch(self, tests: list[str]) -> None:
        """Where every test is `assert f(literals) == literal` with f the solution's (MBPP's usual shape,
        the code task's), ask all the calls at once, in the tests' order: one round trip, not one a
        test. Only arguments cross, as they would one at a time; the comparison stays here."""
        lines = []
        for test in tests:
            try:
                (node,) = ast.parse(test).body
                cmp = node.test
                ok = type(node) is ast.Assert and type(cmp) is ast.Compare and len(cmp.ops) == 1
                ok = ok and type(cmp.ops[0]) is ast.Eq and type(cmp.left) is ast.Call and not cmp.left.keywords
                target = self.ns.get(cmp.left.func.id) if ok and type(cmp.left.func) is ast.Name else None
                if type(target) is not Remote:
                    return
                ast.literal_eval(cmp.comparators[0])
                args = [encode(ast.literal_eval(a), self.to_data) for a in cmp.left.args]
            except (ValueError, TypeError, SyntaxError, AttributeError, MemoryError, RecursionError):
                return
            lines.append(json.dumps({"op": "call", "ref": target._id, "args": args, "kwargs": {}}) + "\n")
        if sum(map(len, lines)) < 1 << 15:  # under a pipe's buffer: this write never waits on the solution
            self.send("".join(lines))
            self.sent = lines

    def to_data(self, v):
        if type(v) is Remote and v._peer is self:
            return {"ref": v._id}
        if id(v) in self.globals and self.ns.get(self.globals[id(v)]) is v:
            return {"g": self.globals[id(v)]}
        raise TypeError(f"a {type(v).__name__} cannot be passed to the solution")

    def value(self, x):
        def other(tag, val):
            if tag == "ref":
                return Remote(val, self)
            self.flags.add("protocol")
            raise ValueError(tag)

        return decode(x, other)

    def ask(self, op, rid, args, kwargs=None, want=None):
        if self.gone:
            raise Gone("gone")
        msg = {"op": op, "ref": rid, "args": [encode(a, self.to_data) for a in args]}
        msg["kwargs"] = {str(k): encode(v, self.to_data) for k, v in (kwargs or {}).items()}
        line = json.dumps(msg) + "\n"
        if self.sent and self.sent[0] == line:  # asked already (prefetch): its reply is the next one
            self.sent.pop(0)
        else:
            while self.sent:  # not what was prefetched: those replies come first
                self.sent.pop(0)
                self.read()
            self.send(line)
        reply = self.read()
        if "raise" in reply:
            cls = getattr(builtins, str(reply["raise"]), None)
            if not (isinstance(cls, type) and issubclass(cls, Exception)):
                cls = RuntimeError
            raise cls(str(reply.get("msg", "")))
        try:
            got = self.value(reply["ok"])
            for a, new in zip(args, reply.get("args") or []):  # what the call did to a list, dict or set
                if new is not None and type(a) in (list, dict, set, bytearray):
                    b = self.value(new)
                    if type(b) is list and type(a) is list or type(b) is bytearray and type(a) is bytearray:
                        a[:] = b
                    elif type(a) in (dict, set) and type(b) is type(a):
                        a.clear(), a.update(b)
        except (KeyError, TypeError, ValueError):
            self.flags.add("protocol")
            raise Gone("protocol") from None
        if want is not None and type(got) is not want:
            raise TypeError(f"{op} gave a {type(got).__name__}")
        return got


def no_more_processes() -> None:
    """Stack a seccomp filter on this process (the jail's stays beneath it): fork, vfork and clone
    without CLONE_THREAD fail with EAGAIN, threads are still made. The two processes the harness
    starts are then all the program's: it holds at most two address spaces (code_tests.ceiling)."""
    ins = [  # classic BPF (code, jt, jf, k), after the jail's filter has refused every other ABI
        (0x20, 0, 0, 0),  # the system call's number
        (0x15, 5, 0, 57),  # fork
        (0x15, 4, 0, 58),  # vfork
        (0x15, 0, 2, 56),  # clone: its flags; anything else allowed
        (0x20, 0, 0, 16),
        (0x45, 0, 1, 0x00010000),  # CLONE_THREAD
        (0x06, 0, 0, 0x7FFF0000),  # allow
        (0x06, 0, 0, 0x00050000 | 11),  # EAGAIN
    ]
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in ins))

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = Fprog(len(ins), ctypes.addressof(code))
    if ctypes.CDLL(None).prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise SystemExit("the harness could not limit its processes")  # no report: every test 0


def checker(pid: int, calls: int, replies: int, output: int, decoy: str) -> None:
    no_more_processes()
    if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0: the solution cannot read this process
        raise SystemExit("the checker could not make itself undumpable")  # no report: every test 0
    job = json.loads(sys.stdin.readline())  # only now: the solution's process never held it
    sys.stdin = open(os.devnull)
    deadline = time.monotonic() + float(job["deadline_s"])
    sys.path[:] = [p for p in sys.path if p and not p.startswith("/tmp")]  # the solution writes /tmp
    ns = {"__name__": "__main__"}
    outcomes, tests = [], job["tests"]
    try:
        exec(compile(job["setup"], "setup", "exec"), ns)
    except BaseException:  # noqa: BLE001
        ns = None
    peer = Peer(pid, calls, replies, output, deadline, ns or {})
    peer.decoy = decoy
    try:
        ready = peer.read()
        names = ready.get("names") if ns is not None else None
        if type(names) is not dict:
            raise Gone("the solution failed")
        for k, x in names.items():
            if k in ns or hasattr(builtins, k):  # the setup's names and builtins stay the checker's own
                continue
            mod = (
                str(x["mod"]) if type(x) is dict and set(x) == {"mod"} else k if k in sys.stdlib_module_names else None
            )
            if mod is not None:  # a module, or a name the tests may read as one (math.isclose): the checker's own
                if mod.split(".")[0] in sys.stdlib_module_names:
                    try:
                        ns[k] = importlib.import_module(mod)
                    except ImportError:
                        pass
                continue
            try:
                ns[k] = peer.value(x)
            except (KeyError, TypeError, ValueError):
                peer.flags.add("protocol")
                raise Gone("protocol") from None
    except Gone:
        outcomes = [0] * len(tests)
    else:
        peer.prefetch(tests)
        for test in tests:
            try:
                exec(compile(test, "test", "exec"), ns)
                outcomes.append(1)
            except BaseException:  # noqa: BLE001  Gone included: that test needed the solution
                outcomes.append(0)
    peer.stop()
    print("\n" + job["nonce"] + json.dumps({"outcomes": outcomes, "hostile": sorted(peer.flags)}), flush=True)


def main() -> None:
    sys.set_int_max_str_digits(0)
    (cr, cw), (rr, rw), (orr, ow) = os.pipe(), os.pipe(), os.pipe()
    decoy = os.urandom(16).hex()
    pid = os.fork()
    if pid == 0:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(ow, 1)
        os.dup2(ow, 2)
        keep = {0, 1, 2, cr, rw}
        for fd in range(3, max(keep) + 64):
            if fd not in keep:
                try:
                    os.close(fd)
                except OSError:
                    pass
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False, buffering=1)
        sys.stderr = open(2, "w", closefd=False, buffering=1)
        try:
            no_more_processes()
            solution_side(cr, rw, decoy)
        finally:
            os._exit(0)
    for fd in (cr, rw, ow):
        os.close(fd)
    checker(pid, cw, rr, orr, decoy)


if __name__ == "__main__":
    main()
