// Package pki is tokenbroker's small certificate authority and its one TLS
// package.
//
// It creates and loads the CA that operators control, issues server
// certificates for brokers and client certificates that carry a cluster's
// SPIFFE-style identity (spiffe://<trust-domain>/cluster/<name>, as the single
// URI SAN), parses PEM from untrusted sources with size and count limits, and
// owns every TLS setting in the project: ServerTLSConfig and ClientTLSConfig
// are the only profiles, both TLS 1.3 only, both fed by a CertReloader so that
// certificates rotate without a restart.
//
// Clock and randomness are inputs (CAOptions.Now, CAOptions.Rand); the package
// keeps no mutable global state. Private keys are ECDSA P-256 and are never
// logged or printed: callers identify certificates by Fingerprint.
//
// Default lifetimes are DefaultCALifetime (5 years), DefaultServerLifetime
// (90 days) and DefaultClientLifetime (24 hours, the lifetime of enrolled and
// renewed cluster certificates). Every certificate's NotBefore is backdated by
// Backdate to tolerate clock skew between clusters.
package pki
