"""In the shape of DeepSpeedExamples' training/cifar/cifar10_deepspeed.py (written anew): its
config in code, deepspeed.initialize building the training loader, an evaluation loader of
batch 4, engine.backward/engine.step; random 3x16x16 images instead of CIFAR-10, on the CPU.

usage: ds_cifar.py RECORD.json [--local_rank N]: rank 0 writes its per-step losses.
"""

import argparse
import json
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # a CPU machine (DeepSpeed probes otherwise)

import deepspeed
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator

parser = argparse.ArgumentParser()
parser.add_argument("record")
parser.add_argument("--local_rank", type=int, default=-1)
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()

deepspeed.init_distributed()
g = torch.Generator().manual_seed(1)
images = torch.randn(160, 3, 16, 16, generator=g)
labels = (images[:, 0].mean((1, 2)) > 0).long() + 2 * (images[:, 2].mean((1, 2)) > 0).long()
trainset = torch.utils.data.TensorDataset(images[:128], labels[:128])
testset = torch.utils.data.TensorDataset(images[128:], labels[128:])
testloader = torch.utils.data.DataLoader(testset, batch_size=4, shuffle=False)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(6 * 6 * 6, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


torch.manual_seed(0)
net = Net()
parameters = filter(lambda p: p.requires_grad, net.parameters())
lr, weight_decay = 0.001, 3e-7
ds_config = {
    "train_batch_size": 16,
    "steps_per_print": 1000,
    "optimizer": {"type": "Adam", "params": {"lr": lr, "weight_decay": weight_decay,
                                             "torch_adam": True}},
    "zero_optimization": {"stage": 1},
}
model_engine, optimizer, trainloader, __ = deepspeed.initialize(args=args, model=net, model_parameters=parameters, training_data=trainset, config=ds_config)  # noqa: E501
local_device = get_accelerator().device_name(model_engine.local_rank)
local_rank = model_engine.local_rank
criterion = nn.CrossEntropyLoss()
losses = []
for epoch in range(args.epochs):
    for i, data in enumerate(trainloader):
        inputs, labels = data[0].to(local_device), data[1].to(local_device)
        outputs = model_engine(inputs)
        loss = criterion(outputs, labels)
        model_engine.backward(loss)
        model_engine.step()
        losses.append(loss.item())
correct = total = 0
with torch.no_grad():
    for images, labels in testloader:
        outputs = net(images.to(local_device))
        correct += (outputs.argmax(1) == labels.to(local_device)).sum().item()
        total += labels.size(0)
if local_rank == 0:
    print(f"Accuracy of the network on the {total} test images: {100 * correct / total:.1f} %")
    with open(args.record, "w") as f:
        json.dump({"losses": losses}, f)
