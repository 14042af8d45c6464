"""The one transport seam: the only package that imports paramiko."""
