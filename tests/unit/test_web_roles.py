"""Console users and roles without a server: the users file (ax_kombu.web.users), the role
map and roles (ax_kombu.web.security), who a request is (ax_kombu.web.access), and
``ax web adduser``."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from ax_kombu.cli import main
from ax_kombu.exceptions import ConfigurationError
from ax_kombu.web.access import Access
from ax_kombu.web.security import (
    LOCAL_IDENTITY,
    TOKEN_IDENTITY,
    Identity,
    Keys,
    check_bind,
    parse_role_map,
)
from ax_kombu.web.users import UsersFile, add_user, load, parse

pytestmark = pytest.mark.timeout(60)


def test_each_role_may_do_what_the_weaker_ones_may_and_no_more() -> None:
    viewer, operator, admin = (Identity("u", r) for r in ("viewer", "operator", "admin"))
    assert viewer.may("viewer") and not viewer.may("operator") and not viewer.may("admin")
    assert operator.may("viewer") and operator.may("operator") and not operator.may("admin")
    assert admin.may("viewer") and admin.may("operator") and admin.may("admin")
    assert TOKEN_IDENTITY == Identity("token", "admin")


def test_role_map_reads_pairs_and_a_default_and_refuses_bad_items() -> None:
    assert parse_role_map(" alice=admin, bob = operator ,*=viewer,") == {
        "alice": "admin", "bob": "operator", "*": "viewer"}
    assert parse_role_map("") == {}
    for bad, says in (("alice", "NAME=ROLE"), ("alice=root", "unknown role 'root'"),
                      ("alice=admin,alice=viewer", "given twice"),
                      ("al ice=admin", "bad user name")):
        with pytest.raises(ConfigurationError, match=says):
            parse_role_map(bad)


def test_add_user_writes_an_argon2_hash_mode_0600_and_replaces_a_user(tmp_path: Path) -> None:
    path = tmp_path / "users"
    assert add_user(path, "alice", "operator", "pw-one") is True
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    text = path.read_text()
    assert "pw-one" not in text and "alice:operator:$argon2id$" in text
    assert add_user(path, "bob", "viewer", "pw-two") is True
    assert add_user(path, "alice", "admin", "pw-three") is False
    users = load(path)
    assert {n: u.role for n, u in users.items()} == {"alice": "admin", "bob": "viewer"}
    assert [p.name for p in tmp_path.iterdir()] == ["users"]  # no temporary file left
    checker = UsersFile(path)
    assert checker.check("alice", "pw-three") == Identity("alice", "admin")
    assert checker.check("alice", "pw-one") is None
    assert checker.check("nobody", "pw-three") is None


def test_add_user_refuses_bad_input_and_leaves_the_file_as_it_was(tmp_path: Path) -> None:
    path = tmp_path / "users"
    add_user(path, "alice", "viewer", "pw")
    before = path.read_bytes()
    for name, role, password, says in (("alice", "root", "pw", "unknown role"),
                                       ("a:b", "viewer", "pw", "bad user name"),
                                       ("carol", "viewer", "", "must not be empty")):
        with pytest.raises(ConfigurationError, match=says):
            add_user(path, name, role, password)
    assert path.read_bytes() == before


def test_a_malformed_users_file_is_refused_with_its_line(tmp_path: Path) -> None:
    good = "$argon2id$v=19$m=65536,t=3,p=4$c2FsdA$aGFzaA"
    assert parse(f"# comment\n\nalice:admin:{good}\n") == parse(f"alice:admin:{good}")
    for text, says in ((f"alice:root:{good}", "line 1: unknown role 'root'"),
                       ("# x\nalice:admin", "line 2: not NAME:ROLE:ARGON2 HASH"),
                       (f"a:admin:{good}\na:viewer:{good}", "line 2: user 'a' is given twice")):
        with pytest.raises(ConfigurationError, match=says):
            parse(text)
    broken = tmp_path / "users"
    broken.write_text("alice admin\n")
    with pytest.raises(ConfigurationError, match="line 1"):
        Access.configure(None, {"AX_WEB_USERS": str(broken)})


def test_a_user_removed_or_demoted_in_the_file_is_held_to_it_at_once(tmp_path: Path) -> None:
    path = tmp_path / "users"
    add_user(path, "alice", "admin", "pw")
    access = Access.configure(None, {"AX_WEB_USERS": str(path)})
    session = access.log_in("alice", "pw")
    assert session is not None and access.log_in("alice", "wrong") is None
    assert access.identify(session, None, {}) == Identity("alice", "admin")
    add_user(path, "alice", "viewer", "pw")
    os.utime(path, ns=(1, 1))  # a new modification time even within the clock's tick
    assert access.identify(session, None, {}) == Identity("alice", "viewer")
    access.log_out(session)
    assert access.identify(session, None, {}) is None


def test_identify_token_header_and_open_loopback() -> None:
    assert Access(Keys(None)).identify(None, None, {}) == LOCAL_IDENTITY
    token = Access(Keys("t0ken"))
    assert token.identify(None, "Bearer t0ken", {}) == TOKEN_IDENTITY
    assert token.identify(token.keys.session, None, {}) == TOKEN_IDENTITY
    assert token.identify("forged", "Bearer nope", {}) is None
    proxied = Access.configure(None, {"AX_WEB_TRUSTED_HEADER": "X-Forwarded-User",
                                      "AX_WEB_ROLE_MAP": "alice=admin,bob=operator"})
    assert proxied.identify(None, None, {"X-Forwarded-User": "bob"}) == Identity("bob",
                                                                                 "operator")
    assert proxied.identify(None, None, {"X-Forwarded-User": "eve"}) is None  # no "*"
    assert proxied.identify(None, None, {}) is None
    anyone = Access.configure(None, {"AX_WEB_TRUSTED_HEADER": "X-Forwarded-User",
                                     "AX_WEB_ROLE_MAP": "*=viewer"})
    assert anyone.identify(None, None, {"X-Forwarded-User": "eve"}) == Identity("eve",
                                                                                "viewer")
    with pytest.raises(ConfigurationError, match="needs AX_WEB_ROLE_MAP"):
        Access.configure(None, {"AX_WEB_TRUSTED_HEADER": "X-Forwarded-User"})


def test_users_or_a_header_guard_a_public_address_as_the_token_does() -> None:
    check_bind("0.0.0.0", None, users=True)
    with pytest.raises(ConfigurationError, match="AX_WEB_USERS"):
        check_bind("0.0.0.0", None, users=False)


def test_ax_web_adduser_from_stdin_and_its_refusals(tmp_path: Path) -> None:
    path = tmp_path / "users"
    runner = CliRunner()
    done = runner.invoke(main, ["web", "adduser", "alice", "--role", "operator",
                                "--password-stdin"], input="s3cret\n",
                         env={"AX_WEB_USERS": str(path)}, prog_name="ax")
    assert done.exit_code == 0, done.output
    assert done.stdout.strip() == f"added alice (operator) in {path}"
    assert UsersFile(path).check("alice", "s3cret") == Identity("alice", "operator")
    bad = runner.invoke(main, ["web", "adduser", "bob", "--role", "root", "--password-stdin"],
                        input="x\n", env={"AX_WEB_USERS": str(path)}, prog_name="ax")
    assert bad.exit_code == 2 and "root" in bad.stderr
    nowhere = runner.invoke(main, ["web", "adduser", "bob", "--role", "viewer",
                                   "--password-stdin"], input="x\n",
                            env={"AX_WEB_USERS": ""}, prog_name="ax")
    assert nowhere.exit_code == 2
    assert nowhere.stderr.strip() == ("ax: error: name the users file: --file PATH or "
                                      "AX_WEB_USERS")
    assert set(load(path)) == {"alice"}


def test_ax_web_refuses_a_malformed_users_file_or_role_map_in_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "users"
    broken.write_text("alice:root:$argon2id$v=19$x\n")
    for env, says in (({"AX_WEB_USERS": str(broken)}, "line 1: unknown role 'root'"),
                      ({"AX_WEB_TRUSTED_HEADER": "X-User", "AX_WEB_ROLE_MAP": "bob=boss"},
                       "AX_WEB_ROLE_MAP: unknown role 'boss'")):
        done = CliRunner().invoke(main, ["web", "--port", "0"], env=env, prog_name="ax")
        assert done.exit_code == 2, done.output
        [line] = done.stderr.strip().splitlines()
        assert line.startswith("ax: error: ") and says in line
