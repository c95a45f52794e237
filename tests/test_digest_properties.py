"""contentDigest and context recipe ref stability (issue 2 acceptance, core.canonical rule).

Property tests: equivalent spellings of a task (TOML key order, inline vs table form, 2 vs
2.0, NFC vs NFD, extra cron whitespace) give the same digest; every semantic change gives
another; ``enabled`` is head state and is not covered by the digest.
"""

from __future__ import annotations

import string
import tomllib
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qlagent.core.canonical import canonical_json, content_digest, recipe_ref, snapshot_ref
from qlagent.core.definitions import parse_task_file, prepare_recipe, prepare_task

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Text whose NFC and NFD forms differ (precomposed letters) plus plain ASCII.
accented = st.text(alphabet="aeoué ñÅçÖ" + string.ascii_letters, min_size=0, max_size=12)
env_names = st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True).filter(lambda k: not k.startswith("QL3_"))
label_keys = st.text(alphabet=string.ascii_lowercase + "-", min_size=1, max_size=8)


@st.composite
def task_specs(draw) -> dict:
    """A valid task as structured values (rendered to TOML by ``render``)."""
    spec = {
        "name": draw(st.from_regex(r"[a-z0-9][a-z0-9-]{0,10}", fullmatch=True)),
        "description": draw(accented),
        "schedule": draw(st.sampled_from(["*/5 * * * *", "0 3 * * *", "@once", "@boot", "30 */2 * * 1-5"])),
        "timeout_s": draw(st.integers(1, 86_400)),
        "grace_s": draw(st.integers(0, 300)),
        "concurrency": draw(st.sampled_from(["single", "parallel"])),
        "network": draw(st.sampled_from(["none", "default_route", "interface:wan"])),
        "priority": draw(st.integers(-1000, 1000)),
        "retry": {"max_attempts": draw(st.integers(1, 10)), "backoff_s": draw(st.integers(0, 3600))},
        "labels": draw(st.dictionaries(label_keys, accented, max_size=4)),
        "env": draw(st.dictionaries(env_names, accented, max_size=5)),
    }
    if draw(st.booleans()):
        spec["command"] = ["/bin/echo"] + draw(st.lists(st.text(string.ascii_letters + " -", max_size=6), max_size=4))
    else:
        spec["shell"] = draw(st.sampled_from(["/bin/sh", "/bin/bash"]))
        spec["script"] = "echo " + draw(st.text(string.ascii_letters, min_size=1, max_size=10))
    return spec


def toml_value(v, *, form: str = "NFC") -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        s = unicodedata.normalize(form, v)
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x, form=form) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f'"{k}" = {toml_value(x, form=form)}' for k, x in v.items()) + "}"
    raise TypeError(v)


def render(spec: dict, *, reverse: bool = False, tables: bool = False, floats: bool = False,
           form: str = "NFC", wide_cron: bool = False) -> str:
    """One spelling of ``spec`` as a TOML task file."""
    spec = {**spec, "retry": dict(spec["retry"])}
    if floats:                                   # 2 → 2.0 for every duration in seconds
        spec["timeout_s"], spec["grace_s"] = float(spec["timeout_s"]), float(spec["grace_s"])
        spec["retry"]["backoff_s"] = float(spec["retry"]["backoff_s"])
    keys = list(spec)
    if reverse:
        keys.reverse()
    scalar_lines, table_parts = [], []
    for k in keys:
        v = spec[k]
        if isinstance(v, dict):
            v = dict(reversed(list(v.items()))) if reverse else v
            if tables:
                body = "".join(f'"{ik}" = {toml_value(iv, form=form)}\n' for ik, iv in v.items())
                table_parts.append(f"[task.{k}]\n{body}")
                continue
        text = toml_value(v, form=form)
        if k == "schedule" and wide_cron:
            text = text.replace(" ", "   ")
        scalar_lines.append(f"{k} = {text}\n")
    return "[[task]]\n" + "".join(scalar_lines) + "".join(table_parts)


def digest_of(text: str) -> tuple[str, str]:
    p = prepare_task(parse_task_file(tomllib.loads(text))[0], 0)
    return p.content_digest, p.recipe_ref


@SETTINGS
@given(task_specs(), st.booleans(), st.booleans(), st.booleans(), st.booleans())
def test_equivalent_spellings_share_the_digest(spec, reverse, tables, floats, wide_cron):
    base = digest_of(render(spec))
    variant = digest_of(render(spec, reverse=reverse, tables=tables, floats=floats, form="NFD",
                               wide_cron=wide_cron))
    assert variant == base


def test_inline_vs_table_and_int_vs_float_explicitly():
    inline = ('[[task]]\nname = "t"\ncommand = ["/bin/true"]\ntimeout_s = 2\n'
              'retry = { max_attempts = 3, backoff_s = 5 }\nenv = { B = "2", A = "1" }\n')
    table = ('[[task]]\nenv.A = "1"\nenv.B = "2"\ntimeout_s = 2.0\nname = "t"\n'
             'command = ["/bin/true"]\n[task.retry]\nbackoff_s = 5.0\nmax_attempts = 3\n')
    assert digest_of(inline) == digest_of(table)


# Each mutation changes exactly one semantic field of a base spec.
BASE = {"name": "t", "description": "d", "schedule": "*/5 * * * *", "timeout_s": 60, "grace_s": 5,
        "concurrency": "single", "network": "none", "priority": 0,
        "retry": {"max_attempts": 1, "backoff_s": 10}, "labels": {"team": "net"}, "env": {"A": "1"},
        "command": ["/bin/echo", "x"]}
MUTATIONS = {
    "name": lambda s: s.update(name="u"),
    "description": lambda s: s.update(description="e"),
    "schedule": lambda s: s.update(schedule="*/6 * * * *"),
    "schedule-list": lambda s: s.update(schedule=["*/5 * * * *", "@boot"]),
    "timezone": lambda s: s.update(timezone="Europe/Berlin"),
    "timeout_s": lambda s: s.update(timeout_s=61),
    "timeout_ms-precision": lambda s: s.update(timeout_s=60.001),
    "grace_s": lambda s: s.update(grace_s=6),
    "concurrency": lambda s: s.update(concurrency="parallel"),
    "network": lambda s: s.update(network="default_route"),
    "network-iface": lambda s: s.update(network="interface:wan"),
    "priority": lambda s: s.update(priority=1),
    "retry.max_attempts": lambda s: s["retry"].update(max_attempts=2),
    "retry.backoff_s": lambda s: s["retry"].update(backoff_s=11),
    "labels-value": lambda s: s["labels"].update(team="ops"),
    "labels-key": lambda s: s.update(labels={"owner": "net"}),
    "env-value": lambda s: s["env"].update(A="2"),
    "env-key": lambda s: s.update(env={"B": "1"}),
    "secrets": lambda s: s.update(secrets={"TOKEN": "tok"}),
    "command-arg": lambda s: s.update(command=["/bin/echo", "y"]),
    "command-split": lambda s: s.update(command=["/bin/echo", "x", ""]),
    "command-path": lambda s: s.update(command=["/usr/bin/echo", "x"]),
    "cwd": lambda s: s.update(cwd="/tmp"),
    "shell": lambda s: (s.pop("command"), s.update(shell="/bin/sh", script="/bin/echo x")),
}


def _mutated(name: str) -> dict:
    import copy
    spec = copy.deepcopy(BASE)
    MUTATIONS[name](spec)
    return spec


def _render_any(spec: dict) -> str:
    out = "[[task]]\n"
    for k, v in spec.items():
        out += f"{k} = {toml_value(v)}\n"
    return out


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_every_semantic_change_changes_the_digest(mutation):
    base_digest, base_ref = digest_of(_render_any(BASE))
    digest, ref = digest_of(_render_any(_mutated(mutation)))
    assert digest != base_digest
    if mutation.startswith(("env", "secrets")):
        assert ref != base_ref                   # the recipe changed, so its ref did
    else:
        assert ref == base_ref                   # the recipe is independent of the rest


def test_all_mutations_are_pairwise_distinct():
    digests = {m: digest_of(_render_any(_mutated(m)))[0] for m in MUTATIONS}
    assert len(set(digests.values())) == len(digests)


def test_enabled_is_head_state_not_content():
    on = digest_of(_render_any(BASE))
    off = digest_of(_render_any({**BASE, "enabled": False}))
    assert on == off


@SETTINGS
@given(st.dictionaries(env_names, accented, max_size=6), st.dictionaries(env_names, st.sampled_from(["a", "b.c"]),
                                                                          max_size=3), st.randoms())
def test_recipe_ref_stable_under_order_and_normal_form(env, secrets, rnd):
    secrets = {k: v for k, v in secrets.items() if k not in env}
    _, ref = prepare_recipe("", env, secrets)
    items = list(env.items())
    rnd.shuffle(items)
    shuffled = {k: unicodedata.normalize("NFD", v) for k, v in items}
    s_items = list(secrets.items())
    rnd.shuffle(s_items)
    _, ref2 = prepare_recipe("", shuffled, dict(s_items))
    assert ref2 == ref and ref.startswith("localctx:sha256:") and len(ref) == len("localctx:sha256:") + 64


@SETTINGS
@given(st.dictionaries(env_names, accented, min_size=1, max_size=5), st.data())
def test_recipe_ref_changes_with_any_value(env, data):
    _, ref = prepare_recipe("", env, {})
    key = data.draw(st.sampled_from(sorted(env)))
    changed = dict(env)
    changed[key] = env[key] + "!"
    assert prepare_recipe("", changed, {})[1] != ref
    # the same name as a SecretRef instead of a public value is another recipe
    as_secret = {k: v for k, v in env.items() if k != key}
    assert prepare_recipe("", as_secret, {key: "s"})[1] != ref


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**53, 2**53) | accented,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(string.ascii_letters, max_size=5), inner,
                                                                max_size=4),
    max_leaves=20)


@SETTINGS
@given(st.dictionaries(st.text(string.ascii_letters, max_size=6), json_values, max_size=6), st.randoms())
def test_canonical_json_ignores_key_order(doc, rnd):
    def shuffle(v):
        if isinstance(v, dict):
            items = [(k, shuffle(x)) for k, x in v.items()]
            rnd.shuffle(items)
            return dict(items)
        if isinstance(v, list):
            return [shuffle(x) for x in v]
        return v
    a = canonical_json(doc)
    assert canonical_json(shuffle(doc)) == a
    assert content_digest(doc) == content_digest(shuffle(doc))


def test_canonical_json_shape_and_refusals():
    assert canonical_json({"b": 1, "a": [True, None, "x"]}) == b'{"a":[true,null,"x"],"b":1}'
    assert canonical_json({"k": "e\u0301"}) == canonical_json({"k": "\u00e9"})
    with pytest.raises(TypeError):
        canonical_json({"t": 2.0})                  # durations are integer ms before hashing
    with pytest.raises(ValueError):
        canonical_json({"e\u0301": 1, "\u00e9": 2})  # keys colliding under NFC
    assert snapshot_ref(3, "a" * 64) == "qltd:v1:3:" + "a" * 64
    assert recipe_ref("b" * 64) == "localctx:sha256:" + "b" * 64
