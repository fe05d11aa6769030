"""content text as UTF-8 bytes: ``transcript_contents.prompt_text`` / ``output_text`` become
``bytea`` (BLOB on SQLite) holding the text's UTF-8 encoding, so text with NUL (U+0000), which
PostgreSQL ``text`` cannot store, is kept exactly (``auditor.db.models.Utf8Text``).

Downgrade converts back to text and refuses (naming how many rows) when a stored text holds NUL.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-04 17:14:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLE = "transcript_contents"
COLUMNS = ("prompt_text", "output_text")


def _postgres() -> bool:
    return op.get_bind().dialect.name == "postgresql"


def upgrade() -> None:
    if _postgres():
        for column in COLUMNS:
            op.alter_column(TABLE, column, type_=sa.LargeBinary(), existing_type=sa.Text(), existing_nullable=False,
                            postgresql_using=f"convert_to({column}, 'UTF8')")
        return
    with op.batch_alter_table(TABLE) as batch:
        for column in COLUMNS:
            batch.alter_column(column, type_=sa.LargeBinary(), existing_type=sa.Text(), existing_nullable=False)
    # SQLite keeps the copied values as TEXT whatever the column type says: store their bytes.
    op.execute(f"UPDATE {TABLE} SET " + ", ".join(f"{c} = CAST({c} AS BLOB)" for c in COLUMNS))


def downgrade() -> None:
    nul = " OR ".join(f"position('\\x00'::bytea in {c}) > 0" if _postgres() else f"instr({c}, x'00') > 0"
                      for c in COLUMNS)
    holding = op.get_bind().execute(sa.text(f"SELECT count(*) FROM {TABLE} WHERE {nul}")).scalar_one()
    if holding:
        raise RuntimeError(f"cannot downgrade: {holding} rows of {TABLE} hold NUL (U+0000), which a text "
                           "column cannot store; erase or keep them before downgrading")
    if _postgres():
        for column in COLUMNS:
            op.alter_column(TABLE, column, type_=sa.Text(), existing_type=sa.LargeBinary(), existing_nullable=False,
                            postgresql_using=f"convert_from({column}, 'UTF8')")
        return
    with op.batch_alter_table(TABLE) as batch:
        for column in COLUMNS:
            batch.alter_column(column, type_=sa.Text(), existing_type=sa.LargeBinary(), existing_nullable=False)
    op.execute(f"UPDATE {TABLE} SET " + ", ".join(f"{c} = CAST({c} AS TEXT)" for c in COLUMNS))
