// Package pki is tokenbroker's small certificate authority and its one TLS
// package: everything about the certificates, keys, join tokens and TLS
// settings that let clusters trust each other without a shared long-lived
// secret.
//
// # Certificate authority
//
// NewCA makes the CA that operators control, LoadCA and LoadCAChain read it
// back. A CA is a self-signed root or an intermediate below one
// (CAOptions.PathLen 1 and NewIntermediate, what `pki init --intermediate`
// makes, so that the root key can live offline). The CA issues server
// certificates for brokers (IssueServer) and client certificates that carry a
// cluster's SPIFFE-style identity, spiffe://<trust-domain>/cluster/<name>, as
// the single URI SAN (IssueClient, or SignClient for a CSR the cluster sent;
// see ClusterIdentity and IdentityFromCert). Every certificate issued by an
// intermediate comes with its chain (KeyPair.CertPEM is the leaf followed by
// CA.Chain), so peers trust the root alone: CA.BundlePEM is the trust bundle.
//
// # Enrollment
//
// A new cluster joins with a join token: a short-lived JWT (ES256, signed by
// the key of the CA that signs client certificates) naming the identity it may
// enroll as (CA.IssueJoinToken, JoinTokenVerifier). It sends the token with a
// CSR (NewCSR, ParseCSRPEM) to the broker's enrollment listener
// (EnrollmentTLSConfig), after checking the trust bundle it fetched against a
// pinned CA fingerprint (VerifyBundleFingerprint). Join tokens are single
// use; the broker enforces that in the Kubernetes API, not this package.
//
// # TLS and rotation
//
// This package owns every TLS setting in the project: ServerTLSConfig,
// ServerTLSConfigReloading, EnrollmentTLSConfig and ClientTLSConfig are the
// only profiles, all TLS 1.3 only. Certificates and keys come from a
// CertReloader and the trust bundle from a PoolReloader, both of which poll
// their files, so that rotating a certificate or a CA (adding the new CA to the
// bundle, then removing the old one) needs no restart; a bad new file is
// refused and the old one stays in service. The signing CA comes from a
// CAReloader, which follows its files the same way.
//
// # Conventions
//
// PEM input from files and peers is untrusted: every parser bounds its input
// and refuses anything but the expected blocks. Clock and randomness are
// inputs (CAOptions.Now, CAOptions.Rand, JoinTokenOptions); the package keeps
// no mutable global state. Private keys are ECDSA P-256 and are never logged
// or printed: callers identify certificates by Fingerprint and join tokens by
// their ID (jti).
//
// Default lifetimes are DefaultCALifetime (5 years), DefaultServerLifetime
// (90 days), DefaultClientLifetime (24 hours, the lifetime of enrolled and
// renewed cluster certificates) and DefaultJoinTokenTTL (10 minutes). Every
// certificate's NotBefore is backdated by Backdate to tolerate clock skew
// between clusters; serial numbers are 128 random bits.
package pki
