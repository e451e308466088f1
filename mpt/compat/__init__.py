"""Drop-in replacements for APIs that training code of another era still imports."""
