"""The data paths that read nodes' checkpoint files: :mod:`.base` (the ``Source``
interface and what every path shares), :mod:`.stream` (one ``ckpt.stream`` session per node
over ssh, locally or through Slurm; :mod:`.session` is that session), :mod:`.sftp` (the
paramiko fallback), :mod:`.transfer` (hashing and verified writes into DEST), and
:mod:`.factory` (``open_source``: the path ``--via`` names)."""
