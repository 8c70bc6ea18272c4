// 020 — image classification with transfer learning: Accelerate's cv_example
// in C++. A synthetic image set (4 classes of shapes: circle, cross, square,
// triangle; random colours, places and sizes; 400 JPEG files of 32x32 named
// <label>_<n>.jpg) is written first. Phase 1 pre-trains a small ResNet-style
// CNN on it and saves it with accelerator.save_model; phase 2 loads those
// weights (ckpt::load_module), re-initialises the classifier head,
// freezes the encoder and trains only the head with Adam and OneCycleLR.
// Both phases run on 2 processes started by notebook_launcher, with
// Accelerator<backend::Gloo, precision::Bf16>; accuracy on the held-out 20 %
// is gathered with gather_for_metrics (exactly one prediction per image).
// Run: ./build/examples/020-image-classification [work_dir]   (default ./020-image-classification.data)
// Expected output (last lines; the digits may differ on another machine):
//   pre-training: epoch 11 loss 0.0870473
//   epoch 0: 77/80 correct, accuracy 0.9625
//   ...
//   epoch 3: 79/80 correct, accuracy 0.9875
//   encoder unchanged since pre-training: yes
//   final accuracy 0.9875 (chance 0.25, required >= 0.8)
// Exit status 0 when the final accuracy is at least 0.80 and the encoder did not change.
#include <accel/accel.hpp>
#include <stb/stb_image.h>
#include <stb/stb_image_write.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------
// The synthetic image set.

constexpr int kStoredSize = 32;  // the JPEG files are 32x32 RGB
const std::array<std::string, 4> kShapes = {"circle", "cross", "square", "triangle"};

bool inside(const std::string& shape, double dx, double dy, double r) {
  if (shape == "circle") return dx * dx + dy * dy <= r * r;
  if (shape == "square") return std::abs(dx) <= 0.8 * r && std::abs(dy) <= 0.8 * r;
  if (shape == "cross")
    return (std::abs(dx) <= r / 3 && std::abs(dy) <= r) || (std::abs(dy) <= r / 3 && std::abs(dx) <= r);
  // triangle pointing up: half-width grows from 0 at the top to r at the bottom
  return dy >= -r && dy <= r && std::abs(dx) <= (dy + r) / 2;
}

/// Writes per_class pictures of every shape to dir as <shape>_<n>.jpg.
void write_image_set(const fs::path& dir, int per_class, unsigned seed) {
  fs::create_directories(dir);
  std::mt19937 rng(seed);
  auto uniform = [&](double lo, double hi) { return std::uniform_real_distribution<>(lo, hi)(rng); };
  std::vector<unsigned char> pixels(kStoredSize * kStoredSize * 3);
  for (const auto& shape : kShapes) {
    for (int n = 0; n < per_class; ++n) {
      // A light shape on a dark background or the other way round.
      const bool light = uniform(0, 1) < 0.5;
      std::array<double, 3> fg, bg;
      for (int c = 0; c < 3; ++c) {
        fg[c] = light ? uniform(150, 255) : uniform(0, 100);
        bg[c] = light ? uniform(0, 100) : uniform(150, 255);
      }
      const double r = uniform(8, 12);
      const double cx = uniform(r + 1, kStoredSize - r - 1), cy = uniform(r + 1, kStoredSize - r - 1);
      for (int y = 0; y < kStoredSize; ++y)
        for (int x = 0; x < kStoredSize; ++x) {
          const bool in = inside(shape, x + 0.5 - cx, y + 0.5 - cy, r);
          for (int c = 0; c < 3; ++c) {
            const double v = (in ? fg[c] : bg[c]) + uniform(-12, 12);
            pixels[(y * kStoredSize + x) * 3 + c] = static_cast<unsigned char>(std::clamp(v, 0.0, 255.0));
          }
        }
      const fs::path file = dir / (shape + "_" + std::to_string(n) + ".jpg");
      if (stbi_write_jpg(file.c_str(), kStoredSize, kStoredSize, 3, pixels.data(), 90) == 0)
        throw std::runtime_error("cannot write " + file.string());
    }
  }
}

// ---------------------------------------------------------------------------
// Transforms, on tensors.

/// HWC uint8 pixels -> CHW float in [0, 1] (torchvision's ToTensor).
torch::Tensor to_tensor(const unsigned char* pixels, int height, int width) {
  auto hwc = torch::from_blob(const_cast<unsigned char*>(pixels), {height, width, 3}, torch::kUInt8);
  return hwc.permute({2, 0, 1}).to(torch::kFloat).div(255.0).contiguous();
}

/// Bilinear resize of a CHW image to size x size (torchvision's Resize).
torch::Tensor resize(const torch::Tensor& image, int64_t size) {
  namespace F = torch::nn::functional;
  return F::interpolate(image.unsqueeze(0), F::InterpolateFuncOptions()
                                                .size(std::vector<int64_t>{size, size})
                                                .mode(torch::kBilinear)
                                                .align_corners(false))
      .squeeze(0);
}

/// torchvision's RandomResizedCrop: a crop of random area (scale of the
/// image) and aspect ratio, resized to size x size; the centre crop when ten
/// draws do not fit.
torch::Tensor random_resized_crop(const torch::Tensor& image, int64_t size, double min_scale = 0.5,
                                  double max_scale = 1.0) {
  const int64_t h = image.size(1), w = image.size(2);
  auto draw = [](double lo, double hi) { return lo + (hi - lo) * torch::rand({1}).item<double>(); };
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double area = h * w * draw(min_scale, max_scale);
    const double ratio = std::exp(draw(std::log(3.0 / 4), std::log(4.0 / 3)));
    const auto cw = static_cast<int64_t>(std::lround(std::sqrt(area * ratio)));
    const auto ch = static_cast<int64_t>(std::lround(std::sqrt(area / ratio)));
    if (cw < 1 || ch < 1 || cw > w || ch > h) continue;
    const int64_t top = torch::randint(0, h - ch + 1, {1}).item<int64_t>();
    const int64_t left = torch::randint(0, w - cw + 1, {1}).item<int64_t>();
    return resize(image.narrow(1, top, ch).narrow(2, left, cw), size);
  }
  return resize(image, size);
}

// ---------------------------------------------------------------------------
// A dataset of image files; the label is in the file name.

struct ImageFiles : torch::data::datasets::Dataset<ImageFiles> {
  std::vector<fs::path> files;
  std::vector<int64_t> labels;
  bool train = false;
  int64_t image_size = 28;

  torch::data::Example<> get(size_t i) override {
    int width = 0, height = 0, channels = 0;
    unsigned char* pixels = stbi_load(files.at(i).c_str(), &width, &height, &channels, 3);
    if (pixels == nullptr)
      throw std::runtime_error("cannot decode " + files[i].string() + ": " + stbi_failure_reason());
    auto image = to_tensor(pixels, height, width);
    stbi_image_free(pixels);
    image = train ? random_resized_crop(image, image_size) : resize(image, image_size);
    image = (image - 0.5) / 0.25;  // Normalize
    return {image, torch::tensor(labels[i])};
  }
  torch::optional<size_t> size() const override { return files.size(); }
};

struct Split {
  ImageFiles train, eval;
  std::vector<std::string> id_to_label;
};

/// Every *.jpg in dir, labelled by ^(.*)_\d+\.jpg$; 80 % train, 20 % eval
/// (the same split on every process: a fixed seed).
Split load_split(const fs::path& dir, int64_t image_size) {
  const std::regex pattern(R"(^(.*)_\d+\.jpg$)");
  std::vector<std::pair<fs::path, std::string>> found;
  for (const auto& entry : fs::directory_iterator(dir)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (std::regex_match(name, m, pattern)) found.emplace_back(entry.path(), m[1]);
  }
  std::sort(found.begin(), found.end());  // directory order is unspecified
  std::set<std::string> unique;
  for (const auto& f : found) unique.insert(f.second);
  Split s;
  s.id_to_label.assign(unique.begin(), unique.end());
  std::map<std::string, int64_t> label_to_id;
  for (size_t i = 0; i < s.id_to_label.size(); ++i) label_to_id[s.id_to_label[i]] = static_cast<int64_t>(i);

  std::shuffle(found.begin(), found.end(), std::mt19937(42));
  const size_t n_train = found.size() * 8 / 10;
  for (size_t i = 0; i < found.size(); ++i) {
    ImageFiles& part = i < n_train ? s.train : s.eval;
    part.files.push_back(found[i].first);
    part.labels.push_back(label_to_id.at(found[i].second));
  }
  s.train.train = true;
  s.train.image_size = s.eval.image_size = image_size;
  return s;
}

// ---------------------------------------------------------------------------
// A small ResNet: a stem, two residual blocks, pooling (the encoder), a linear head.

struct ResidualBlockImpl : torch::nn::Module {
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, project{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr}, project_bn{nullptr};

  ResidualBlockImpl(int64_t in, int64_t out, int64_t stride) {
    using torch::nn::Conv2dOptions;
    conv1 = register_module("conv1", torch::nn::Conv2d(Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(out));
    conv2 = register_module("conv2", torch::nn::Conv2d(Conv2dOptions(out, out, 3).padding(1).bias(false)));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(out));
    if (stride != 1 || in != out) {
      project = register_module("project", torch::nn::Conv2d(Conv2dOptions(in, out, 1).stride(stride).bias(false)));
      project_bn = register_module("project_bn", torch::nn::BatchNorm2d(out));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    auto y = torch::relu(bn1(conv1(x)));
    y = bn2(conv2(y));
    auto shortcut = project ? project_bn(project(x)) : x;
    return torch::relu(y + shortcut);
  }
};
TORCH_MODULE(ResidualBlock);

struct EncoderImpl : torch::nn::Module {
  torch::nn::Conv2d stem{nullptr};
  torch::nn::BatchNorm2d stem_bn{nullptr};
  ResidualBlock block1{nullptr}, block2{nullptr};

  EncoderImpl() {
    stem = register_module("stem", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 16, 3).stride(2).padding(1).bias(false)));
    stem_bn = register_module("stem_bn", torch::nn::BatchNorm2d(16));
    block1 = register_module("block1", ResidualBlock(16, 16, 1));
    block2 = register_module("block2", ResidualBlock(16, 32, 2));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(stem_bn(stem(x)));
    x = block2(block1(x));
    return x.mean({2, 3});  // global average pooling -> [batch, 32]
  }
};
TORCH_MODULE(Encoder);

struct ClassifierImpl : torch::nn::Module {
  Encoder encoder;
  torch::nn::Linear head{nullptr};

  explicit ClassifierImpl(int64_t num_classes) {
    register_module("encoder", encoder);
    head = register_module("head", torch::nn::Linear(32, num_classes));
  }
  /// A fresh head (as timm's create_model(pretrained=True, num_classes=...)).
  void reset_head(int64_t num_classes) {
    head = replace_module("head", torch::nn::Linear(32, num_classes));
  }
  torch::Tensor forward(torch::Tensor x) { return head(encoder(x)); }
};
TORCH_MODULE(Classifier);

// ---------------------------------------------------------------------------
// The two launched functions.

struct Config {
  std::string image_dir, pretrained_dir;
  int64_t image_size = 28;
  int64_t batch_size = 16;  // per process
  int pretrain_epochs = 12;
  int epochs = 4;
  double lr = 3e-2;
  double min_accuracy = 0.80;
};

using Accel = accel::Accelerator<accel::backend::Gloo, accel::precision::Bf16>;

/// Phase 1: trains the whole network, saves it with save_model.
void pretrain(Config cfg) {
  Accel accelerator;
  accel::set_seed(1);
  auto split = load_split(cfg.image_dir, cfg.image_size);
  Classifier model(static_cast<int64_t>(split.id_to_label.size()));
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(3e-3));
  auto loader = accel::data::make_data_loader(std::move(split.train),
                                              {.batch_size = cfg.batch_size, .shuffle = true, .seed = 1});
  auto [m, opt, dl] = accelerator.prepare(model, optimizer, loader);
  m->train();
  for (int epoch = 0; epoch < cfg.pretrain_epochs; ++epoch) {
    torch::Tensor total = torch::zeros({1});
    for (auto& batch : dl) {
      opt.zero_grad();
      auto loss = torch::cross_entropy_loss(m(batch.data), batch.target);
      accelerator.backward(loss);
      opt.step();
      total += loss.detach();
    }
    const double mean_loss =
        accelerator.reduce(total / dl.size(), accel::Reduction::Mean).item<double>();
    if (epoch == cfg.pretrain_epochs - 1 || epoch % 4 == 0)
      accelerator.print("pre-training: epoch ", epoch, " loss ", mean_loss);
  }
  accelerator.save_model(m, cfg.pretrained_dir);  // main process writes; all wait
}

/// Phase 2: transfer learning: pre-trained encoder frozen, a new head trained.
void training_function(Config cfg) {
  Accel accelerator;
  accel::set_seed(2);
  auto split = load_split(cfg.image_dir, cfg.image_size);
  const auto num_classes = static_cast<int64_t>(split.id_to_label.size());
  const auto eval_size = static_cast<int64_t>(split.eval.files.size());

  Classifier model(num_classes);
  accel::ckpt::load_module(*model, cfg.pretrained_dir);
  model->reset_head(num_classes);
  for (auto& p : model->encoder->parameters()) p.requires_grad_(false);  // before prepare()

  auto train_loader = accel::data::make_data_loader(
      std::move(split.train), {.batch_size = cfg.batch_size, .shuffle = true, .seed = 2});
  auto eval_loader =
      accel::data::make_data_loader(std::move(split.eval), {.batch_size = cfg.batch_size * 2});
  auto [m, train_dl, eval_dl] = accelerator.prepare(model, train_loader, eval_loader);

  // Sized after prepare(): the schedule counts this process's optimizer steps.
  torch::optim::Adam optimizer(m->head->parameters(), torch::optim::AdamOptions(cfg.lr / 25));
  accel::sched::OneCycleLR scheduler(
      optimizer, {.max_lr = cfg.lr, .epochs = cfg.epochs, .steps_per_epoch = train_dl.size()});
  auto [opt, sched] = accelerator.prepare(optimizer, scheduler);

  double accuracy = 0;
  for (int epoch = 0; epoch < cfg.epochs; ++epoch) {
    m->train();
    m->encoder->eval();  // frozen: BatchNorm keeps the pre-trained statistics
    for (auto& batch : train_dl) {
      opt.zero_grad();
      auto loss = torch::cross_entropy_loss(m(batch.data), batch.target);
      accelerator.backward(loss);
      opt.step();
      sched.step();
    }
    m->eval();
    int64_t correct = 0, seen = 0;
    for (auto& batch : eval_dl) {
      torch::NoGradGuard no_grad;
      auto predictions = m(batch.data).argmax(1);
      auto all_predictions = accelerator.gather_for_metrics(predictions);
      auto all_targets = accelerator.gather_for_metrics(batch.target);
      correct += all_predictions.eq(all_targets).sum().item<int64_t>();
      seen += all_targets.size(0);
    }
    if (seen != eval_size)
      throw std::runtime_error("gather_for_metrics gave " + std::to_string(seen) +
                               " predictions for " + std::to_string(eval_size) + " images");
    accuracy = static_cast<double>(correct) / static_cast<double>(seen);
    accelerator.print("epoch ", epoch, ": ", correct, "/", seen, " correct, accuracy ", accuracy);
  }
  // Transfer learning: the encoder (weights and BatchNorm statistics) is still
  // exactly the pre-trained one; only the head learned.
  Classifier pretrained(num_classes);
  accel::ckpt::load_module(*pretrained, cfg.pretrained_dir);
  auto saved = pretrained->encoder->named_parameters();
  for (const auto& b : pretrained->encoder->named_buffers()) saved.insert(b.key() + "#", b.value());
  auto now = m->encoder->named_parameters();
  for (const auto& b : m->encoder->named_buffers()) now.insert(b.key() + "#", b.value());
  for (const auto& item : now)
    if (!torch::equal(item.value(), saved[item.key()]))
      throw std::runtime_error("the frozen encoder changed: " + item.key());
  accelerator.print("encoder unchanged since pre-training: yes");
  accelerator.print("final accuracy ", accuracy, " (chance ", 1.0 / static_cast<double>(num_classes),
                    ", required >= ", cfg.min_accuracy, ")");
  if (accuracy < cfg.min_accuracy)
    throw std::runtime_error("accuracy " + std::to_string(accuracy) + " is below " +
                             std::to_string(cfg.min_accuracy));
}

int main(int argc, char** argv) {
  const fs::path work = argc > 1 ? argv[1] : "020-image-classification.data";
  fs::remove_all(work);
  write_image_set(work / "images", 100, 2024);
  Config cfg{.image_dir = (work / "images").string(), .pretrained_dir = (work / "pretrained").string()};
  const accel::LaunchOptions two_processes{
      .num_processes = 2, .master_port = 0, .timeout = std::chrono::seconds(300)};
  try {
    accel::notebook_launcher(pretrain, std::make_tuple(cfg), two_processes);
    accel::notebook_launcher(training_function, std::make_tuple(cfg), two_processes);
  } catch (const accel::Error& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
  return 0;
}
