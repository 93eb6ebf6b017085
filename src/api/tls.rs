//! TLS for the lane servers (`--tls-cert` / `--tls-key`): PEM files read once at startup into a
//! rustls server configuration (ring provider, TLS 1.2 and 1.3, HTTP/1.1 via ALPN). Errors name
//! the file and what is wrong with it, so a bad deployment fails before the port opens.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {msg}")]
    File { path: PathBuf, msg: String },
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// A server configuration from a PEM certificate chain and a PEM private key (PKCS#8, PKCS#1
/// or SEC1).
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let file_err = |path: &Path, msg: String| TlsError::File { path: path.to_owned(), msg };
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| file_err(cert, format!("cannot read the certificate chain: {e}")))?
        .collect::<Result<_, _>>()
        .map_err(|e| file_err(cert, format!("not a PEM certificate chain: {e}")))?;
    if certs.is_empty() {
        return Err(file_err(cert, "no certificate in the file".into()));
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| file_err(key, format!("no usable private key: {e}")))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| TlsError::Config(format!("the certificate and key do not form a usable pair: {e}")))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
