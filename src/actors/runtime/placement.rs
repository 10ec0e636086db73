//! Placement: which models share a device, which cores each device computes on, and how many
//! compute threads its one pool has. Models naming the same device share it; with
//! `[compute] split = "by-size"` the models on `device = "cpu"` are spread over disjoint core
//! sets sized by their weight bytes instead (see [`thread_budget`]). No two CPU devices ever
//! compute on a common core. A GPU device's pool is one unpinned host thread (its compute is
//! the GPU's): it samples and waits on its stream, sharing a core with a CPU device if any.

use super::threads::thread_budget;
use crate::config::{CoreSplit, DeviceSpec};

/// One device and the models placed on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevicePlan {
    pub spec: DeviceSpec,
    /// Cores its threads are pinned to (empty: not pinned, every core of the process).
    pub pinned: Vec<usize>,
    pub threads: usize,
    /// Model indices, in config order; a model's position here is its slot on the device.
    pub models: Vec<usize>,
}

/// What placement reads of one model.
#[derive(Debug, Clone)]
pub struct ModelPlacement {
    pub device: DeviceSpec,
    pub threads: Option<usize>,
    pub weight_bytes: usize,
}

/// The devices for `models`, given the process's cores (`cores`: the core ids it may run on;
/// `unpinned_threads`: the threads a device over all of them gets).
pub fn plan_devices(
    models: &[ModelPlacement],
    cores: &[usize],
    unpinned_threads: usize,
    split: CoreSplit,
) -> Result<Vec<DevicePlan>, String> {
    let mut specs: Vec<DeviceSpec> = models.iter().map(|m| m.device.clone()).collect();
    let on_cpu: Vec<usize> = (0..models.len())
        .filter(|&i| models[i].device == DeviceSpec::Cpu)
        .collect();
    if split == CoreSplit::BySize && on_cpu.len() > 1 {
        if cores.len() < on_cpu.len() {
            tracing::warn!(
                cores = cores.len(),
                models = on_cpu.len(),
                "split = \"by-size\" needs a core per model; the models share one device"
            );
        } else {
            let bytes: Vec<usize> = on_cpu.iter().map(|&i| models[i].weight_bytes).collect();
            let budget = thread_budget(&vec![None; on_cpu.len()], &bytes, cores.len(), split);
            let mut next = 0;
            for (&i, n) in on_cpu.iter().zip(budget) {
                specs[i] = DeviceSpec::CpuCores(cores[next..next + n].to_vec());
                next += n;
            }
        }
    }
    let mut devices: Vec<DevicePlan> = Vec::new();
    for (i, spec) in specs.into_iter().enumerate() {
        if let Some(d) = devices.iter_mut().find(|d| d.spec == spec) {
            d.models.push(i);
            continue;
        }
        let pinned = match &spec {
            DeviceSpec::CpuCores(set) => {
                if let Some(c) = set.iter().find(|c| !cores.contains(c)) {
                    return Err(format!(
                        "device \"{spec}\" names core {c}, which this process may not run on (cores {})",
                        DeviceSpec::CpuCores(cores.to_vec())
                    ));
                }
                set.clone()
            }
            _ => Vec::new(),
        };
        let threads = match &spec {
            // A GPU model's host work (sampling, routing features) is one thread's: more would
            // only take cores from models on the CPU.
            DeviceSpec::Cuda(_) => 1,
            _ if pinned.is_empty() => unpinned_threads,
            _ => pinned.len(),
        };
        devices.push(DevicePlan {
            spec,
            pinned,
            threads,
            models: vec![i],
        });
    }
    for d in &mut devices {
        if let Some(t) = d.models.iter().find_map(|&i| models[i].threads) {
            d.threads = t;
        }
        d.threads = d.threads.max(1);
    }
    Ok(devices)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(device: &str, bytes: usize) -> ModelPlacement {
        ModelPlacement {
            device: device.parse().unwrap(),
            threads: None,
            weight_bytes: bytes,
        }
    }

    #[test]
    fn models_on_the_cpu_share_one_device_with_every_core() {
        let d = plan_devices(
            &[model("cpu", 400), model("cpu", 1000)],
            &[0, 1],
            2,
            CoreSplit::Shared,
        )
        .unwrap();
        assert_eq!(d.len(), 1);
        assert_eq!((d[0].threads, d[0].models.clone()), (2, vec![0, 1]));
        assert!(d[0].pinned.is_empty());
    }

    #[test]
    fn by_size_gives_each_model_disjoint_cores() {
        let cores: Vec<usize> = (0..16).collect();
        let d = plan_devices(
            &[model("cpu", 400), model("cpu", 1000)],
            &cores,
            16,
            CoreSplit::BySize,
        )
        .unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!(d[0].pinned, (0..5).collect::<Vec<_>>());
        assert_eq!(d[1].pinned, (5..16).collect::<Vec<_>>());
        assert_eq!((d[0].threads, d[1].threads), (5, 11));
    }

    #[test]
    fn core_sets_pin_their_threads_and_must_exist() {
        let d = plan_devices(
            &[model("cpu:0", 1), model("cpu:1", 1), model("cpu:1", 1)],
            &[0, 1],
            2,
            CoreSplit::Shared,
        )
        .unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!(
            (d[1].pinned.clone(), d[1].models.clone()),
            (vec![1], vec![1, 2])
        );
        let err = plan_devices(&[model("cpu:2-3", 1)], &[0, 1], 2, CoreSplit::Shared).unwrap_err();
        assert!(err.contains("core 2"), "{err}");
    }

    #[test]
    fn gpu_models_get_a_device_each_and_one_host_thread() {
        let d = plan_devices(
            &[
                model("cpu", 1),
                model("cuda:0", 9),
                model("cuda:1", 9),
                model("cuda:0", 1),
            ],
            &[0, 1],
            2,
            CoreSplit::BySize,
        )
        .unwrap();
        let got: Vec<_> = d
            .iter()
            .map(|d| (d.spec.to_string(), d.threads, d.models.clone()))
            .collect();
        assert_eq!(
            got,
            [
                ("cpu".to_string(), 2, vec![0]),
                ("cuda:0".to_string(), 1, vec![1, 3]),
                ("cuda:1".to_string(), 1, vec![2]),
            ]
        );
    }

    #[test]
    fn a_model_may_set_its_device_threads() {
        let mut m = model("cpu", 1);
        m.threads = Some(1);
        let d = plan_devices(&[m, model("cpu", 1)], &[0, 1], 2, CoreSplit::Shared).unwrap();
        assert_eq!(d[0].threads, 1);
    }
}
