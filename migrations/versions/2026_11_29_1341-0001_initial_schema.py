"""initial schema: API keys, transcripts + contents, the log (leaves, checkpoints), replay jobs,
access log; on PostgreSQL, triggers that make the append-only tables reject UPDATE/DELETE/TRUNCATE.

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-29 13:41:46.863697
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


APPEND_ONLY_TABLES = ("transcripts", "log_leaves", "log_checkpoints", "access_log")
REJECT_FUNCTION = "verbatim_reject_modification"


def _create_append_only_triggers() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(
        f"""
        CREATE FUNCTION {REJECT_FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'table % is append-only: % refused', TG_TABLE_NAME, TG_OP
                USING ERRCODE = 'insufficient_privilege';
        END
        $$
        """
    )
    for table in APPEND_ONLY_TABLES:
        op.execute(
            f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
            f"FOR EACH ROW EXECUTE FUNCTION {REJECT_FUNCTION}()"
        )
        op.execute(
            f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {table} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {REJECT_FUNCTION}()"
        )


def _drop_append_only_triggers() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in APPEND_ONLY_TABLES:
        op.execute(f"DROP TRIGGER {table}_no_truncate ON {table}")
        op.execute(f"DROP TRIGGER {table}_append_only ON {table}")
    op.execute(f"DROP FUNCTION {REJECT_FUNCTION}()")


def upgrade() -> None:
    op.create_table('access_log',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('key_id', sa.String(length=32), nullable=False),
    sa.Column('tenant', sa.String(length=64), nullable=False),
    sa.Column('action', sa.String(length=16), nullable=False),
    sa.Column('target', sa.String(length=256), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint("action IN ('read', 'replay', 'export', 'list')", name=op.f('ck_access_log_action')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_access_log'))
    )
    op.create_index('ix_access_log_tenant_at', 'access_log', ['tenant', 'at'], unique=False)

    op.create_table('api_keys',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('key_hash', sa.String(length=64), nullable=False),
    sa.Column('tenant', sa.String(length=64), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("role IN ('client', 'auditor', 'admin')", name=op.f('ck_api_keys_role')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_keys')),
    sa.UniqueConstraint('key_hash', name=op.f('uq_api_keys_key_hash'))
    )
    op.create_index(op.f('ix_api_keys_tenant'), 'api_keys', ['tenant'], unique=False)

    op.create_table('log_checkpoints',
    sa.Column('tree_size', sa.BigInteger(), autoincrement=False, nullable=False),
    sa.Column('root_hash', sa.LargeBinary(length=32), nullable=False),
    sa.Column('note', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('tree_size', name=op.f('pk_log_checkpoints'))
    )
    op.create_table('transcripts',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('tenant', sa.String(length=64), nullable=False),
    sa.Column('sequence', sa.BigInteger(), nullable=False),
    sa.Column('previous_digest', sa.String(length=64), nullable=True),
    sa.Column('api', sa.String(length=32), nullable=False),
    sa.Column('model', sa.String(length=128), nullable=False),
    sa.Column('deterministic', sa.Boolean(), nullable=False),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('finish_reason', sa.String(length=16), nullable=True),
    sa.Column('seed', sa.String(length=24), nullable=True),
    sa.Column('prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('completion_tokens', sa.Integer(), nullable=False),
    sa.Column('system_fingerprint', sa.String(length=32), nullable=False),
    sa.Column('key_id', sa.String(length=64), nullable=False),
    sa.Column('api_key_id', sa.String(length=32), nullable=True),
    sa.Column('envelope', sa.LargeBinary(), nullable=False),
    sa.Column('payload_digest', sa.String(length=64), nullable=False),
    sa.Column('envelope_digest', sa.String(length=64), nullable=False),
    sa.Column('log_index', sa.BigInteger(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('completed_at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint("status IN ('completed', 'client_disconnected', 'error')", name=op.f('ck_transcripts_status')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_transcripts')),
    sa.UniqueConstraint('envelope_digest', name=op.f('uq_transcripts_envelope_digest')),
    sa.UniqueConstraint('log_index', name=op.f('uq_transcripts_log_index')),
    sa.UniqueConstraint('tenant', 'sequence', name=op.f('uq_transcripts_tenant_sequence'))
    )
    op.create_index(op.f('ix_transcripts_model'), 'transcripts', ['model'], unique=False)
    op.create_index('ix_transcripts_tenant_created_at', 'transcripts', ['tenant', 'created_at'], unique=False)

    op.create_table('replay_jobs',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('tenant', sa.String(length=64), nullable=False),
    sa.Column('transcript_id', sa.String(length=36), nullable=False),
    sa.Column('requested_by', sa.String(length=32), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('result', sa.JSON(), nullable=True),
    sa.Column('attestation', sa.LargeBinary(), nullable=True),
    sa.Column('log_index', sa.BigInteger(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("status IN ('queued', 'running', 'done', 'failed')", name=op.f('ck_replay_jobs_status')),
    sa.ForeignKeyConstraint(['transcript_id'], ['transcripts.id'], name=op.f('fk_replay_jobs_transcript_id_transcripts')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_replay_jobs'))
    )
    op.create_index('ix_replay_jobs_tenant_created_at', 'replay_jobs', ['tenant', 'created_at'], unique=False)
    op.create_index(op.f('ix_replay_jobs_transcript_id'), 'replay_jobs', ['transcript_id'], unique=False)

    op.create_table('transcript_contents',
    sa.Column('transcript_id', sa.String(length=36), nullable=False),
    sa.Column('salt', sa.LargeBinary(), nullable=False),
    sa.Column('prompt_token_ids', sa.JSON(), nullable=False),
    sa.Column('output_token_ids', sa.JSON(), nullable=False),
    sa.Column('token_logprobs', sa.JSON(), nullable=False),
    sa.Column('request_json', sa.JSON(), nullable=False),
    sa.Column('prompt_text', sa.Text(), nullable=False),
    sa.Column('output_text', sa.Text(), nullable=False),
    sa.ForeignKeyConstraint(['transcript_id'], ['transcripts.id'], name=op.f('fk_transcript_contents_transcript_id_transcripts')),
    sa.PrimaryKeyConstraint('transcript_id', name=op.f('pk_transcript_contents'))
    )
    op.create_table('log_leaves',
    sa.Column('index', sa.BigInteger(), autoincrement=False, nullable=False),
    sa.Column('leaf_hash', sa.LargeBinary(length=32), nullable=False),
    sa.Column('entry', sa.LargeBinary(length=32), nullable=False),
    sa.Column('kind', sa.String(length=24), nullable=False),
    sa.Column('transcript_id', sa.String(length=36), nullable=True),
    sa.Column('replay_job_id', sa.String(length=36), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint("kind IN ('transcript', 'replay_attestation')", name=op.f('ck_log_leaves_kind')),
    sa.ForeignKeyConstraint(['replay_job_id'], ['replay_jobs.id'], name=op.f('fk_log_leaves_replay_job_id_replay_jobs')),
    sa.ForeignKeyConstraint(['transcript_id'], ['transcripts.id'], name=op.f('fk_log_leaves_transcript_id_transcripts')),
    sa.PrimaryKeyConstraint('index', name=op.f('pk_log_leaves'))
    )
    op.create_index(op.f('ix_log_leaves_replay_job_id'), 'log_leaves', ['replay_job_id'], unique=False)
    op.create_index(op.f('ix_log_leaves_transcript_id'), 'log_leaves', ['transcript_id'], unique=False)
    _create_append_only_triggers()


def downgrade() -> None:
    _drop_append_only_triggers()
    op.drop_index(op.f('ix_log_leaves_transcript_id'), table_name='log_leaves')
    op.drop_index(op.f('ix_log_leaves_replay_job_id'), table_name='log_leaves')

    op.drop_table('log_leaves')
    op.drop_table('transcript_contents')
    op.drop_index(op.f('ix_replay_jobs_transcript_id'), table_name='replay_jobs')
    op.drop_index('ix_replay_jobs_tenant_created_at', table_name='replay_jobs')

    op.drop_table('replay_jobs')
    op.drop_index('ix_transcripts_tenant_created_at', table_name='transcripts')
    op.drop_index(op.f('ix_transcripts_model'), table_name='transcripts')

    op.drop_table('transcripts')
    op.drop_table('log_checkpoints')
    op.drop_index(op.f('ix_api_keys_tenant'), table_name='api_keys')

    op.drop_table('api_keys')
    op.drop_index('ix_access_log_tenant_at', table_name='access_log')

    op.drop_table('access_log')
