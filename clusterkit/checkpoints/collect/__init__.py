"""collect-ckpt: :mod:`.verb` is the verb (list -> verify -> choose -> copy -> manifest);
:mod:`.discover` verifies completeness, :mod:`.choose` and :mod:`.fromreplicas` pick the
copy of each file, :mod:`.manifest` writes DEST's record, :mod:`.prune` and
:mod:`.scatter` are ``--prune-sources`` and ``--scatter``."""
