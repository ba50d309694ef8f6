"""kvconductor.app and kvconductor.cli: the old paths users name keep working.

``gunicorn -k kvconductor.app.KvConductorWorker 'kvconductor.app:gunicorn_app()'`` and
entry points written against ``kvconductor.cli:main`` resolve without a warning; any other
name of the modules that moved resolves with a ``DeprecationWarning`` that names its new
home; an unknown name is an ``AttributeError``.
"""

from __future__ import annotations

import warnings

import pytest

import kvconductor.app
import kvconductor.cli
from kvconductor.http import api, query, resource
from kvconductor.serve import cli, gunicorn


def test_public_gunicorn_names_resolve_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kvconductor.app.KvConductorWorker is gunicorn.KvConductorWorker
        assert kvconductor.app.gunicorn_app is gunicorn.gunicorn_app
        from kvconductor.app import KvConductorWorker, gunicorn_app

    assert (KvConductorWorker, gunicorn_app) == (gunicorn.KvConductorWorker, gunicorn.gunicorn_app)


def test_old_app_names_warn_and_resolve():
    with pytest.warns(DeprecationWarning, match=r"kvconductor\.http\.api\.create_app"):
        assert kvconductor.app.create_app is api.create_app
    with pytest.warns(DeprecationWarning, match="QueryFastPath"):
        assert kvconductor.app.QueryFastPath is api.QueryFastPath


def test_old_app_names_of_the_rooms_split_out_of_the_app_name_their_room():
    with pytest.warns(DeprecationWarning, match=r"kvconductor\.http\.resource\.read_body"):
        assert kvconductor.app.read_body is resource.read_body
    with pytest.warns(DeprecationWarning, match=r"kvconductor\.http\.query\.QueryResource"):
        assert kvconductor.app.QueryResource is query.QueryResource


def test_unknown_names_are_attribute_errors():
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = kvconductor.app.no_such_name
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = kvconductor.cli.no_such_name


def test_old_cli_main_runs_the_cli(capsys):
    # kvconductor.cli:main is the same command: --version prints and exits 0.
    with pytest.raises(SystemExit) as exit_info:
        kvconductor.cli.main(["--version"])
    assert exit_info.value.code == 0
    assert kvconductor.__version__ in capsys.readouterr().out


def test_old_cli_names_warn_and_resolve():
    with pytest.warns(DeprecationWarning, match=r"kvconductor\.serve\.cli\.build_parser"):
        assert kvconductor.cli.build_parser is cli.build_parser
