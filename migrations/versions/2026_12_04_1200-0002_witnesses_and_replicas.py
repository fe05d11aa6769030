"""witness cosignatures of checkpoints; replay job leases for several server processes.

``checkpoint_cosignatures`` is append-only on PostgreSQL like the log tables; ``replay_jobs`` gains
``claimed_by`` and ``lease_expires_at`` (a job whose runner died is taken back once its lease passes).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-04 12:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

REJECT_FUNCTION = "verbatim_reject_modification"  # created by 0001


def upgrade() -> None:
    op.create_table(
        'checkpoint_cosignatures',
        sa.Column('tree_size', sa.BigInteger(), nullable=False),
        sa.Column('witness', sa.String(length=255), nullable=False),
        sa.Column('timestamp', sa.BigInteger(), nullable=False),
        sa.Column('signature_line', sa.Text(), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(['tree_size'], ['log_checkpoints.tree_size'],
                                name=op.f('fk_checkpoint_cosignatures_tree_size_log_checkpoints')),
        sa.PrimaryKeyConstraint('tree_size', 'witness', name=op.f('pk_checkpoint_cosignatures')),
    )
    with op.batch_alter_table('replay_jobs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('claimed_by', sa.String(length=128), nullable=True))
        batch_op.add_column(sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        op.execute("CREATE TRIGGER checkpoint_cosignatures_append_only BEFORE UPDATE OR DELETE ON "
                   f"checkpoint_cosignatures FOR EACH ROW EXECUTE FUNCTION {REJECT_FUNCTION}()")
        op.execute("CREATE TRIGGER checkpoint_cosignatures_no_truncate BEFORE TRUNCATE ON "
                   f"checkpoint_cosignatures FOR EACH STATEMENT EXECUTE FUNCTION {REJECT_FUNCTION}()")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER checkpoint_cosignatures_no_truncate ON checkpoint_cosignatures")
        op.execute("DROP TRIGGER checkpoint_cosignatures_append_only ON checkpoint_cosignatures")
    with op.batch_alter_table('replay_jobs', schema=None) as batch_op:
        batch_op.drop_column('lease_expires_at')
        batch_op.drop_column('claimed_by')
    op.drop_table('checkpoint_cosignatures')
