//! Which vrdma device a program sees: the one `VRDMA_DEVICE` names, else the one a
//! configuration file names, else the one the guest service shares when it listens at its
//! default socket. A program run with none of these sees no device at all.

use std::io;
use std::path::{Path, PathBuf};

use vrdma_guest::service::protocol::DEFAULT_SOCKET as DEFAULT_SERVICE_SOCKET;

/// The environment variable naming the device: a backend's vhost-user socket path, `pci`
/// (the VM's vrdma PCI device), `pci:DDDD:BB:DD.F`, or `service[:PATH]` (the guest service).
pub const DEVICE_VARIABLE: &str = "VRDMA_DEVICE";
/// The environment variable naming the configuration file, if not the default.
pub const CONFIG_VARIABLE: &str = "VRDMA_CONFIG";
/// The configuration file read when neither variable is set: its first line that is neither
/// empty nor a `#` comment names the device, as `VRDMA_DEVICE` would.
pub const DEFAULT_CONFIG_FILE: &str = "/etc/vrdma/device";
pub use vrdma_guest::DEVICE_NAME;

/// Where the device target came from, for messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    Variable,
    File(PathBuf),
    /// Nothing named a device, and the guest service listens at its default socket.
    DefaultService,
}

/// The configured device: what `vrdma_guest::Device::open` is given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceTarget {
    pub target: String,
    pub source: Source,
}

impl DeviceTarget {
    /// "socket /run/vrdma.sock (from VRDMA_DEVICE)", for messages.
    pub fn describe(&self) -> String {
        let what = if self.target.starts_with("pci") {
            format!("PCI device {}", self.target)
        } else if self.target.starts_with("service") {
            format!("the vrdma service ({})", self.target)
        } else {
            format!("socket {}", self.target)
        };
        match &self.source {
            Source::Variable => format!("{what} (from {DEVICE_VARIABLE})"),
            Source::File(path) => format!("{what} (from {})", path.display()),
            Source::DefaultService => format!("{what} (nothing else configured)"),
        }
    }
}

/// Why no device is configured.
#[derive(Debug, PartialEq, Eq)]
pub enum NotConfigured {
    /// Neither variable is set and the default file does not exist: the quiet case.
    Nothing,
    /// The configuration exists but is unusable.
    Invalid(String),
}

impl std::fmt::Display for NotConfigured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotConfigured::Nothing => write!(
                f,
                "no vrdma device is configured and no vrdma service listens at {DEFAULT_SERVICE_SOCKET}: set {DEVICE_VARIABLE} to a backend's socket path, pci or service:PATH, or write one to {DEFAULT_CONFIG_FILE}"
            ),
            NotConfigured::Invalid(why) => f.write_str(why),
        }
    }
}

/// The configured device, from the process environment and file system.
pub fn configured_device() -> Result<DeviceTarget, NotConfigured> {
    resolve(
        |name| std::env::var(name).ok(),
        |path| std::fs::read_to_string(path),
        || Path::new(DEFAULT_SERVICE_SOCKET).exists(),
    )
}

/// The configured device, given how to read variables and files.
pub fn resolve(
    variable: impl Fn(&str) -> Option<String>,
    read_file: impl Fn(&Path) -> io::Result<String>,
    service_listens: impl Fn() -> bool,
) -> Result<DeviceTarget, NotConfigured> {
    if let Some(value) = variable(DEVICE_VARIABLE) {
        let target = value.trim();
        if target.is_empty() {
            return Err(NotConfigured::Invalid(format!(
                "{DEVICE_VARIABLE} is set but empty: give it a backend's socket path or pci"
            )));
        }
        return Ok(DeviceTarget {
            target: target.to_string(),
            source: Source::Variable,
        });
    }
    let (path, explicit) = match variable(CONFIG_VARIABLE) {
        Some(path) => (PathBuf::from(path), true),
        None => (PathBuf::from(DEFAULT_CONFIG_FILE), false),
    };
    let contents = match read_file(&path) {
        Ok(contents) => contents,
        Err(e) if e.kind() == io::ErrorKind::NotFound && !explicit => {
            return match service_listens() {
                true => Ok(DeviceTarget {
                    target: "service".to_string(),
                    source: Source::DefaultService,
                }),
                false => Err(NotConfigured::Nothing),
            };
        }
        Err(e) => {
            return Err(NotConfigured::Invalid(format!(
                "cannot read the vrdma configuration {}: {e}",
                path.display()
            )))
        }
    };
    let target = contents
        .lines()
        .map(str::trim)
        .find(|line| !line.is_empty() && !line.starts_with('#'))
        .ok_or_else(|| {
            NotConfigured::Invalid(format!(
                "{} names no device: write a backend's socket path or pci in it",
                path.display()
            ))
        })?;
    Ok(DeviceTarget {
        target: target.to_string(),
        source: Source::File(path),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_file(_: &Path) -> io::Result<String> {
        Err(io::ErrorKind::NotFound.into())
    }

    #[test]
    fn the_variable_wins_over_any_file() {
        let target = resolve(
            |name| (name == DEVICE_VARIABLE).then(|| " /run/vrdma.sock\n".to_string()),
            |_| Ok("pci".into()),
            || true,
        )
        .unwrap();
        assert_eq!(target.target, "/run/vrdma.sock");
        assert_eq!(target.source, Source::Variable);
        assert_eq!(
            target.describe(),
            "socket /run/vrdma.sock (from VRDMA_DEVICE)"
        );
    }

    #[test]
    fn the_file_names_the_device_on_its_first_meaningful_line() {
        let target = resolve(
            |_| None,
            |path| {
                assert_eq!(path, Path::new(DEFAULT_CONFIG_FILE));
                Ok("# vrdma\n\n  pci:0000:00:04.0  \nignored\n".into())
            },
            || true,
        )
        .unwrap();
        assert_eq!(target.target, "pci:0000:00:04.0");
        assert_eq!(
            target.describe(),
            "PCI device pci:0000:00:04.0 (from /etc/vrdma/device)"
        );
    }

    #[test]
    fn nothing_configured_is_quiet_but_says_what_to_set() {
        let err = resolve(|_| None, no_file, || false).unwrap_err();
        assert_eq!(err, NotConfigured::Nothing);
        assert!(err.to_string().contains(DEVICE_VARIABLE), "{err}");
    }

    #[test]
    fn with_nothing_configured_the_guest_service_is_the_device_where_it_listens() {
        let target = resolve(|_| None, no_file, || true).unwrap();
        assert_eq!(target.target, "service");
        assert_eq!(
            target.describe(),
            "the vrdma service (service) (nothing else configured)"
        );
    }

    #[test]
    fn unusable_configuration_is_named() {
        let empty_variable = resolve(|_| Some("  ".into()), no_file, || true).unwrap_err();
        assert!(empty_variable
            .to_string()
            .contains("VRDMA_DEVICE is set but empty"));
        let missing_explicit_file = resolve(
            |name| (name == CONFIG_VARIABLE).then(|| "/nowhere/vrdma".into()),
            no_file,
            || true,
        )
        .unwrap_err();
        assert!(
            missing_explicit_file.to_string().contains("/nowhere/vrdma"),
            "{missing_explicit_file}"
        );
        let comments_only = resolve(|_| None, |_| Ok("# nothing\n".into()), || true).unwrap_err();
        assert!(comments_only.to_string().contains("names no device"));
    }
}
