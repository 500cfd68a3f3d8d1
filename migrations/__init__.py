"""Alembic environment and revisions of the control plane's store (see ``control.db``)."""
