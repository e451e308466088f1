"""In the shape of DeepSpeedExamples' training/cifar/cifar10_deepspeed.py (written anew): its
arguments with deepspeed.add_config_arguments, its config in code (Adam, WarmupLR, gradient
clipping, the dtype and ZeRO stage from flags), deepspeed.init_distributed and
get_accelerator().set_device inside main(), the MoE parameter groups of --moe-param-group
(deepspeed.moe.utils), deepspeed.initialize over several lines building the training loader, the
inputs cast where bfloat16_enabled()/fp16_enabled(), and an evaluation loader of batch 4 in a
test() that reads the engine's local rank; random 3x16x16 images instead of CIFAR-10, on the CPU.

usage: ds_cifar.py RECORD.json [--local_rank N] [--dtype fp32] [--epochs N]: rank 0 writes its
per-step losses, the dtype its inputs were cast to and its test accuracy.
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
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer


def add_argument():
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("record")
    parser.add_argument("-e", "--epochs", default=2, type=int)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--dtype", default="fp32", type=str, choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--stage", default=1, type=int, choices=[0, 1, 2, 3])
    parser.add_argument("--moe-param-group", default=False, action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def create_moe_param_groups(model):
    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    return split_params_into_different_moe_groups_for_optimizer(parameters)


def get_ds_config(args):
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7,
                       "torch_adam": True},  # not in the example: saves building FusedAdam here
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000},
        },
        "gradient_clipping": 1.0,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "initial_scale_power": 15},
        "zero_optimization": {"stage": args.stage},
    }


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


def test(model_engine, testset, local_device, target_dtype, test_batch_size=4):
    testloader = torch.utils.data.DataLoader(
        testset, batch_size=test_batch_size, shuffle=False, num_workers=0
    )
    correct, total = 0, 0
    model_engine.eval()
    with torch.no_grad():
        for images, labels in testloader:
            if target_dtype is not None:
                images = images.to(target_dtype)
            outputs = model_engine(images.to(local_device))
            correct += (outputs.argmax(1) == labels.to(local_device)).sum().item()
            total += labels.size(0)
    if model_engine.local_rank == 0:
        print(f"Accuracy of the network on the {total} test images: {100 * correct / total:.1f} %")
    return correct / total


def main(args):
    deepspeed.init_distributed()
    _local_rank = int(os.environ.get("LOCAL_RANK"))
    get_accelerator().set_device(_local_rank)

    g = torch.Generator().manual_seed(1)
    images = torch.randn(160, 3, 16, 16, generator=g)
    labels = (images[:, 0].mean((1, 2)) > 0).long() + 2 * (images[:, 2].mean((1, 2)) > 0).long()
    trainset = torch.utils.data.TensorDataset(images[:128], labels[:128])
    testset = torch.utils.data.TensorDataset(images[128:], labels[128:])

    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = create_moe_param_groups(net)
    ds_config = get_ds_config(args)
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(  # noqa: RUF059
        args=args,
        model=net,
        model_parameters=parameters,
        training_data=trainset,
        config=ds_config,
    )
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half

    criterion = nn.CrossEntropyLoss()
    losses = []
    for epoch in range(args.epochs):  # noqa: B007
        for i, data in enumerate(trainloader):  # noqa: B007
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
    accuracy = test(model_engine, testset, local_device, target_dtype)
    if local_rank == 0:
        with open(args.record, "w") as f:
            json.dump({"losses": losses, "accuracy": accuracy, "dtype": str(target_dtype)}, f)


if __name__ == "__main__":
    main(add_argument())
