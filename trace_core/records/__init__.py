"""Records: the capture spec and layout, device capture, the host ring, the on-disk store and its reader."""
