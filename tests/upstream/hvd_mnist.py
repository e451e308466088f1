"""In the shape of Horovod's examples/pytorch/pytorch_mnist.py (written anew, not copied), on
scikit-learn's 8x8 digits instead of MNIST (nothing is downloaded), on the CPU. It carries the
example's lines that no one-line edit reaches: ``import horovod`` beside ``horovod.torch``,
everything inside ``train(args)`` with its helpers nested there, the compression line,
hvd.DistributedOptimizer over several lines with compression, op and gradient_predivide_factor,
the learning-rate scaler read from ``--use-adasum`` and the Adasum branch's
hvd.local_size()/hvd.nccl_built(), a training DataLoader over two lines beside a test loader,
and ``horovod.run(train, ...)`` when ``--num-proc`` is given.

usage: hvd_mnist.py RECORD.json [--epochs N] [--num-proc N]: rank 0 writes its per-step losses
and the test loss and accuracy to RECORD.json.
"""

import argparse
import json

import horovod
import horovod.torch as hvd
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn, optim
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("record")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--test-batch-size", type=int, default=1000)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--momentum", type=float, default=0.9)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--fp16-allreduce", action="store_true")
parser.add_argument("--use-adasum", action="store_true")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--num-proc", type=int)
parser.add_argument("--hosts")
parser.add_argument("--communication")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=3)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=3)
        self.fc1 = nn.Linear(80, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


def train(args):
    losses = []

    def train_epoch(epoch):
        model.train()
        train_sampler.set_epoch(epoch)
        for data, target in train_loader:
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())

    def metric_average(val, name):
        tensor = torch.tensor(val)
        avg_tensor = hvd.allreduce(tensor, name=name)
        return avg_tensor.item()

    def test():
        model.eval()
        test_loss, test_accuracy = 0.0, 0.0
        for data, target in test_loader:
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1)
            test_accuracy += pred.eq(target).float().sum().item()
        test_loss /= len(test_sampler)
        test_accuracy /= len(test_sampler)
        return metric_average(test_loss, "avg_loss"), metric_average(test_accuracy,
                                                                     "avg_accuracy")

    hvd.init()
    torch.manual_seed(args.seed)
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())
    torch.set_num_threads(1)

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    train_dataset = TensorDataset(images[:1400], labels[:1400])
    test_dataset = TensorDataset(images[1400:], labels[1400:])
    train_sampler = DistributedSampler(train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = DistributedSampler(test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)

    model = Net()
    lr_scaler = hvd.size() if not args.use_adasum else 1
    if args.cuda:
        model.cuda()
        if args.use_adasum and hvd.nccl_built():
            lr_scaler = hvd.local_size()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)

    for epoch in range(1, args.epochs + 1):
        train_epoch(epoch)
        test_loss, test_accuracy = test()
    if hvd.rank() == 0:
        print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {100 * test_accuracy:.2f}%")
        with open(args.record, "w") as f:
            json.dump({"losses": losses, "test_loss": test_loss, "accuracy": test_accuracy,
                       "world_size": hvd.size(), "lr_scaler": lr_scaler}, f)


if __name__ == "__main__":
    args = parser.parse_args()
    args.cuda = torch.cuda.is_available()
    if args.num_proc:
        models = horovod.run(train,
                             args=(args,),
                             np=args.num_proc,
                             hosts=args.hosts,
                             use_gloo=args.communication == "gloo",
                             use_mpi=args.communication == "mpi")
    else:
        train(args)
