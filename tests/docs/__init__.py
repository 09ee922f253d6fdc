"""What the pages claim, checked against the repository (docs/, README.md), and the image's static checks."""
