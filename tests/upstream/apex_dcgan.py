"""The imports of Apex's examples/dcgan/main_amp.py, in its shape (written anew). Its training
(amp.initialize over two models and optimizers with num_losses=3) is not run here."""

import argparse

import torch
import torch.nn as nn

from apex import amp

parser = argparse.ArgumentParser()
parser.add_argument("--opt_level", default="O1")
