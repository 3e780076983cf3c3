package policy

import (
	"encoding/pem"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/pki"
)

// LoadFile reads, parses and validates the policy at path and the CA
// bundle it names. A relative caFile is taken relative to the policy file.
func LoadFile(path string) (*Policy, error) {
	data, err := pki.ReadFileLimit(path, maxPolicyBytes)
	if err != nil {
		return nil, fmt.Errorf("read policy: %w", err)
	}
	p, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if p.Cluster.CAFile != "" {
		ca, err := pki.ReadFileLimit(caFilePath(path, p.Cluster.CAFile), maxPolicyBytes)
		if err != nil {
			return nil, fmt.Errorf("%s: cluster.caFile: %w", path, err)
		}
		p.Cluster.CAData = string(ca)
	}
	if err := setJWKSFiles(path, p, readJWKSFiles(path, p)); err != nil {
		return nil, err
	}
	return checkedPolicy(path, p)
}

// jwksFilePeers returns the indexes of the peers whose workloadIdentity
// names a jwksFile, in order.
func jwksFilePeers(p *Policy) []int {
	var out []int
	for i := range p.Peers {
		if wi := p.Peers[i].WorkloadIdentity; wi != nil && wi.JWKSFile != "" {
			out = append(out, i)
		}
	}
	return out
}

// readJWKSFiles reads the jwksFile of each peer that names one (nil for a
// file that cannot be read; setJWKSFiles reports it).
func readJWKSFiles(path string, p *Policy) [][]byte {
	var out [][]byte
	for _, i := range jwksFilePeers(p) {
		data, _ := pki.ReadFileLimit(caFilePath(path, p.Peers[i].WorkloadIdentity.JWKSFile), pki.MaxJWKSBytes)
		out = append(out, data)
	}
	return out
}

// setJWKSFiles parses the jwksFile contents read for p (in the order of
// jwksFilePeers) into the peers' workloadIdentity.
func setJWKSFiles(path string, p *Policy, files [][]byte) error {
	var probs []apiv1.FieldError
	for n, i := range jwksFilePeers(p) {
		wi := p.Peers[i].WorkloadIdentity
		field := fmt.Sprintf("peers[%d].workloadIdentity.jwksFile", i)
		if n >= len(files) || files[n] == nil {
			probs = append(probs, apiv1.FieldError{Field: field, Detail: fmt.Sprintf("%s cannot be read", caFilePath(path, wi.JWKSFile))})
			continue
		}
		keys, err := pki.ParseJWKS(files[n])
		if err != nil {
			probs = append(probs, apiv1.FieldError{Field: field, Detail: fmt.Sprintf("%s: %v", caFilePath(path, wi.JWKSFile), err)})
			continue
		}
		wi.keys = keys
	}
	if len(probs) > 0 {
		return fmt.Errorf("%s: %w", path, &apiv1.ValidationError{Document: "policy", Problems: probs})
	}
	return nil
}

// policyFromFiles is LoadFile on content already read: the policy,
// the CA file it names (nil when it names none or could not be read) and
// the jwksFiles of its peers (see readJWKSFiles).
func policyFromFiles(path string, data, ca []byte, jwks [][]byte) (*Policy, error) {
	p, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if p.Cluster.CAFile != "" {
		if ca == nil {
			return nil, fmt.Errorf("%s: cluster.caFile: %s cannot be read", path, caFilePath(path, p.Cluster.CAFile))
		}
		p.Cluster.CAData = string(ca)
	}
	if err := setJWKSFiles(path, p, jwks); err != nil {
		return nil, err
	}
	return checkedPolicy(path, p)
}

// checkedPolicy checks the CA bundle of a parsed policy.
func checkedPolicy(path string, p *Policy) (*Policy, error) {
	if err := checkCABundle([]byte(p.Cluster.CAData)); err != nil {
		return nil, fmt.Errorf("%s: %w", path, &apiv1.ValidationError{Document: "policy", Problems: []apiv1.FieldError{{Field: "cluster.caFile", Detail: err.Error()}}})
	}
	return p, nil
}

// checkCABundle makes sure the bundle holds at least one PEM certificate and
// nothing else, so that a broken file is caught at load, not by a peer's
// kubectl.
func checkCABundle(data []byte) error {
	n := 0
	for {
		var block *pem.Block
		block, data = pem.Decode(data)
		if block == nil {
			break
		}
		if block.Type != "CERTIFICATE" {
			return fmt.Errorf("unexpected PEM block %q in CA bundle", block.Type)
		}
		n++
	}
	if n == 0 {
		return errors.New("no PEM certificate in CA bundle")
	}
	return nil
}

// CheckCABundle reports whether data holds at least one PEM certificate
// and nothing else, as LoadFile requires of cluster.caFile and
// cluster.caData; "tokenbroker config validate" checks a policy with it.
func CheckCABundle(data []byte) error { return checkCABundle(data) }

// Store holds the policy in force. Readers never block; a reload
// swaps the whole policy at once.
type Store struct {
	p atomic.Pointer[Policy]

	mu       sync.Mutex // serialises Store and guards onChange
	onChange []func(old, new *Policy)
}

// OnChange registers f to be called after every Store with the policy
// replaced and the new one, in the order of the stores. f must not block
// for long: the reload waits for it.
func (s *Store) OnChange(f func(old, new *Policy)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.onChange = append(s.onChange, f)
}

// NewStore returns a store holding p (which may be nil: then every
// request is denied and the broker is not ready).
func NewStore(p *Policy) *Store {
	s := &Store{}
	if p != nil {
		s.p.Store(p)
	}
	return s
}

// Load returns the policy in force, or nil.
func (s *Store) Load() *Policy { return s.p.Load() }

// ErrNoPolicy answers a request that needs the policy before one is
// loaded: retryable, the broker is not ready.
var ErrNoPolicy = problem.Errorf(problem.KindUnavailable, "no policy is loaded")

// Current returns the policy in force, or ErrNoPolicy.
func (s *Store) Current() (*Policy, error) {
	if p := s.p.Load(); p != nil {
		return p, nil
	}
	return nil, ErrNoPolicy
}

// Store replaces the policy in force. p must be valid.
func (s *Store) Store(p *Policy) {
	s.mu.Lock()
	defer s.mu.Unlock()
	old := s.p.Swap(p)
	for _, f := range s.onChange {
		f(old, p)
	}
}

// Namespaces are the namespaces the policy in force grants by name; none
// before a policy is loaded.
func (s *Store) Namespaces() []string {
	if p := s.Load(); p != nil {
		return p.Namespaces()
	}
	return nil
}
