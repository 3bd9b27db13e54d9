"""The bottom floor: errors, file writing, stop requests, the training code's hash and the device runtime
(device, precision, DDP). It imports no other voxdiff package (docs/development.md)."""
