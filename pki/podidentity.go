package pki

import (
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"time"
)

// A pod certificate also names its Pod, in its subject: the common name is
// the Pod's name and the serialNumber attribute its uid. They are not
// identities (the URI SAN is the only one): they let a broker refuse one
// Pod (its deny list's pods) and check that the Pod still lives, as the
// source cluster's API server does for the Pod's own tokens.

// PodCertificateBackdate is how far a pod certificate's NotBefore
// precedes its signing, for clocks a little behind: the time it was made
// is NotBefore plus this.
const PodCertificateBackdate = 2 * time.Minute

// ErrNotPodCertificate is wrapped by WorkloadFromChain's refusals.
var ErrNotPodCertificate = errors.New("not a pod certificate of a cluster CA")

// maxPodNameLen is a Pod name's longest (a DNS-1123 subdomain).
const maxPodNameLen = 253

// podSubject is the subject of the pod certificate of the Pod name/uid.
func podSubject(name, uid string) (pkix.Name, error) {
	if name == "" && uid == "" {
		return pkix.Name{}, nil
	}
	if name == "" || len(name) > maxPodNameLen || validateDNSName(name) != nil {
		return pkix.Name{}, fmt.Errorf("%w: Pod name %q is not a DNS-1123 subdomain", ErrInvalidWorkloadIdentity, name)
	}
	if !ValidUID(uid) {
		return pkix.Name{}, fmt.Errorf("%w: Pod uid %q is not a lower-case UUID", ErrInvalidWorkloadIdentity, uid)
	}
	return pkix.Name{CommonName: name, SerialNumber: uid}, nil
}

// IsWorkloadCertificate reports whether cert, not a CA, names a workload
// identity as its only URI SAN: a pod certificate, to be read with
// WorkloadFromChain. It verifies nothing.
func IsWorkloadCertificate(cert *x509.Certificate) bool {
	if cert == nil || cert.IsCA || len(cert.URIs) != 1 {
		return false
	}
	_, _, _, err := ParseWorkloadIdentity(cert.URIs[0].String())
	return err == nil
}

// PodWorkload is what a verified pod certificate says: the cluster whose
// CA signed it, the workload, and the Pod.
type PodWorkload struct {
	// Cluster is the cluster identity of the CA that signed it, which is
	// also the cluster of Identity.
	Cluster string
	// Identity is the workload identity of the leaf's URI SAN.
	Identity       string
	Namespace      string
	ServiceAccount string
	// PodName and PodUID are from the leaf's subject.
	PodName string
	PodUID  string
	// ClusterCA is the CA that signed the leaf.
	ClusterCA *x509.Certificate
}

// WorkloadFromChain reads the workload a pod certificate proves from the
// chains the TLS stack verified for it (leaf first, a trust anchor last).
// The leaf must be a pod certificate (no CA, its only name a
// WorkloadIdentity, client authentication, a Pod in its subject) and, in
// every chain, its issuer must be a cluster CA (ClusterCAIdentity) of the
// leaf's own cluster: a cluster's CA vouches for its own workloads only,
// which X.509 name constraints cannot say. It does not verify signatures or
// validity; the TLS handshake has. Refusals wrap ErrNotPodCertificate.
func WorkloadFromChain(chains [][]*x509.Certificate) (*PodWorkload, error) {
	if len(chains) == 0 || len(chains[0]) == 0 {
		return nil, fmt.Errorf("%w: no verified chain", ErrNotPodCertificate)
	}
	leaf := chains[0][0]
	if leaf.IsCA {
		return nil, fmt.Errorf("%w: the certificate is a CA", ErrNotPodCertificate)
	}
	if len(leaf.URIs) != 1 || len(leaf.DNSNames)+len(leaf.IPAddresses)+len(leaf.EmailAddresses) != 0 {
		return nil, fmt.Errorf("%w: its only name must be one URI SAN", ErrNotPodCertificate)
	}
	id := leaf.URIs[0].String()
	cluster, ns, sa, err := ParseWorkloadIdentity(id)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNotPodCertificate, err)
	}
	var ca *x509.Certificate
	for _, chain := range chains {
		// The leaf, its cluster CA, and a trust anchor at least: a pod
		// certificate signed by a fleet CA itself has no cluster CA.
		if len(chain) < 3 || !chain[0].Equal(leaf) {
			return nil, fmt.Errorf("%w: it is not signed by a cluster CA below a trust anchor", ErrNotPodCertificate)
		}
		own, err := ClusterCAIdentity(chain[1])
		if err != nil {
			return nil, fmt.Errorf("%w: its issuer: %w", ErrNotPodCertificate, err)
		}
		if own != cluster {
			return nil, fmt.Errorf("%w: %s is signed by the cluster CA of %s, not of its own cluster", ErrNotPodCertificate, id, own)
		}
		if ca == nil {
			ca = chain[1]
		}
	}
	if leaf.Subject.SerialNumber == "" {
		return nil, fmt.Errorf("%w: its subject does not name a Pod (common name and serialNumber)", ErrNotPodCertificate)
	}
	if _, err := podSubject(leaf.Subject.CommonName, leaf.Subject.SerialNumber); err != nil {
		return nil, fmt.Errorf("%w: its subject does not name a Pod: %w", ErrNotPodCertificate, err)
	}
	return &PodWorkload{
		Cluster: cluster, Identity: id, Namespace: ns, ServiceAccount: sa,
		PodName: leaf.Subject.CommonName, PodUID: leaf.Subject.SerialNumber, ClusterCA: ca,
	}, nil
}
